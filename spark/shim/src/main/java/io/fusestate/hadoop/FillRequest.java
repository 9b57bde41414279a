package io.fusestate.hadoop;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.attribute.UserDefinedFileAttributeView;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * Asks the fusestate daemon serving a directory to put some of its files into the page cache,
 * through the mount itself: by setting the extended attribute {@code user.fusestate.fill} on the
 * directory, its value the files' names separated by NUL bytes. The daemon stores nothing; it
 * queues the fills. Any process that sees the volume reaches its daemon this way, at whatever
 * path the volume is mounted or bound there and as any user the kernel lets write the
 * directory (a pod's executor), where the daemon's control socket is its own user's only.
 *
 * <p>The caller looks the files up first (the kernel must know an inode to take its pages) and
 * opens them only after asking: the daemon does not fill a file open on its node.
 */
final class FillRequest {
    static final String ATTRIBUTE = "fusestate.fill"; // Java adds the "user." namespace
    static final int VALUE_MAX = 60000; // the kernel takes values of up to 64 KiB

    private FillRequest() {
    }

    /** Asks for {@code files}, one request per directory (more for a long list). The first
     *  directory that refuses ends the request with its error (one not on fusestate refuses). */
    static void ask(List<Path> files) throws IOException {
        Map<Path, List<String>> byDir = new LinkedHashMap<>();
        for (Path f : files) {
            byDir.computeIfAbsent(f.getParent(), k -> new ArrayList<>()).add(f.getFileName().toString());
        }
        for (Map.Entry<Path, List<String>> dir : byDir.entrySet()) {
            UserDefinedFileAttributeView view = Files.getFileAttributeView(dir.getKey(),
                    UserDefinedFileAttributeView.class);
            if (view == null) {
                throw new IOException(dir.getKey() + ": no extended attributes on this file system");
            }
            ByteArrayOutputStream value = new ByteArrayOutputStream();
            for (String name : dir.getValue()) {
                byte[] bytes = name.getBytes(StandardCharsets.UTF_8);
                if (value.size() > 0 && value.size() + 1 + bytes.length > VALUE_MAX) {
                    view.write(ATTRIBUTE, ByteBuffer.wrap(value.toByteArray()));
                    value.reset();
                }
                if (value.size() > 0) {
                    value.write(0);
                }
                value.write(bytes, 0, bytes.length);
            }
            view.write(ATTRIBUTE, ByteBuffer.wrap(value.toByteArray()));
        }
    }
}
