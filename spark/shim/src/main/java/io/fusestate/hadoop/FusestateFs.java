package io.fusestate.hadoop;

import java.io.IOException;
import java.net.URI;
import java.net.URISyntaxException;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.DelegateToFileSystem;

/**
 * The {@code fusestate://} scheme for Hadoop's FileContext API ({@code fs.AbstractFileSystem.fusestate.impl}),
 * which Spark's checkpoint file manager prefers: the same {@link FusestateFileSystem} underneath.
 */
public class FusestateFs extends DelegateToFileSystem {
    public FusestateFs(URI theUri, Configuration conf) throws IOException, URISyntaxException {
        super(theUri, new FusestateFileSystem(), conf, FusestateFileSystem.SCHEME, false);
    }

    @Override
    public int getUriDefaultPort() {
        return -1;
    }
}
