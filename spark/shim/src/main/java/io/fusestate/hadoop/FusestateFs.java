package io.fusestate.hadoop;

import java.io.IOException;
import java.net.URI;
import java.net.URISyntaxException;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.DelegateToFileSystem;
import org.apache.hadoop.fs.Path;

/**
 * The {@code fusestate://} scheme for Hadoop's FileContext API ({@code fs.AbstractFileSystem.fusestate.impl}),
 * which Spark's checkpoint file manager prefers: the same {@link FusestateFileSystem} underneath.
 *
 * <p>Spark writes {@code offsets/N} and {@code commits/N} with a rename that must not overwrite,
 * and relies on it failing when another query (or a second driver) wrote that batch first.
 * Hadoop's FileContext checks for the target and then renames, which two nodes of a shared
 * volume can both pass; here a file's no-overwrite rename is one atomic link instead.
 */
public class FusestateFs extends DelegateToFileSystem {
    public FusestateFs(URI theUri, Configuration conf) throws IOException, URISyntaxException {
        super(theUri, new FusestateFileSystem(), conf, FusestateFileSystem.SCHEME, false);
    }

    @Override
    public void renameInternal(Path src, Path dst, boolean overwrite) throws IOException {
        if (!overwrite && FusestateFileSystem.renameNoReplace(FusestateFileSystem.localPath(src),
                FusestateFileSystem.localPath(dst))) {
            return;
        }
        super.renameInternal(src, dst, overwrite);
    }

    @Override
    public int getUriDefaultPort() {
        return -1;
    }
}
