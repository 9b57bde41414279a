package io.fusestate.hadoop;

import java.io.IOException;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.DirectoryStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.TreeSet;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import java.util.zip.ZipEntry;
import java.util.zip.ZipFile;

/**
 * The files a RocksDB state store's next load reads: its latest snapshot at or below the version
 * the checkpoint's last committed batch leaves ({@code <version>.zip} and the SST and log files
 * its {@code metadata} entry names) and the changelogs after it. The same choice as the Python
 * side's {@code fusestate.spark.snapshot_fill.latest_snapshot_files}, for one store.
 */
final class LatestSnapshot {
    private static final Pattern VERSION = Pattern.compile("^(\\d+)\\.(zip|changelog)$");
    private static final Pattern SST = Pattern.compile("\"dfsSstFileName\"\\s*:\\s*\"([^\"]+)\"");
    private static final Pattern LOG = Pattern.compile("\"dfsLogFileName\"\\s*:\\s*\"([^\"]+)\"");
    private static final int STORE_DEPTH = 3; // state/<operator>/<partition>[/<store name>]

    private LatestSnapshot() {
    }

    /** The checkpoint a store directory belongs to: the parent of its {@code state} directory. */
    static Path checkpointOf(Path store) {
        Path p = store;
        for (int i = 0; i < STORE_DEPTH && p != null; i++) {
            p = p.getParent();
            if (p != null && p.getFileName() != null && p.getFileName().toString().equals("state")
                    && p.getParent() != null && Files.isDirectory(p.getParent().resolve("commits"))) {
                return p.getParent();
            }
        }
        return null;
    }

    /** The version the next load asks for: the last committed batch's plus one, or -1 before any. */
    static long committedVersion(Path checkpoint) throws IOException {
        long last = -1;
        try (DirectoryStream<Path> commits = Files.newDirectoryStream(checkpoint.resolve("commits"))) {
            for (Path c : commits) {
                String name = c.getFileName().toString();
                if (name.matches("\\d+")) {
                    last = Math.max(last, Long.parseLong(name));
                }
            }
        }
        return last < 0 ? -1 : last + 1;
    }

    /** The store's files for its next load, or none when its checkpoint has no commit yet. */
    static List<Path> files(Path store) throws IOException {
        List<Path> out = new ArrayList<>();
        Path checkpoint = checkpointOf(store);
        long version = checkpoint == null ? -1 : committedVersion(checkpoint);
        if (version < 0) {
            return out;
        }
        long snapshot = 0;
        TreeSet<Long> changelogs = new TreeSet<>();
        try (DirectoryStream<Path> entries = Files.newDirectoryStream(store)) {
            for (Path e : entries) {
                Matcher m = VERSION.matcher(e.getFileName().toString());
                if (m.matches() && Long.parseLong(m.group(1)) <= version) {
                    long v = Long.parseLong(m.group(1));
                    if (m.group(2).equals("zip")) {
                        snapshot = Math.max(snapshot, v);
                    } else {
                        changelogs.add(v);
                    }
                }
            }
        }
        if (snapshot > 0) {
            Path zip = store.resolve(snapshot + ".zip");
            out.add(zip);
            try {
                String meta = metadata(zip);
                for (Matcher m = SST.matcher(meta); m.find(); ) {
                    out.add(store.resolve("SSTs").resolve(m.group(1)));
                }
                for (Matcher m = LOG.matcher(meta); m.find(); ) {
                    out.add(store.resolve("logs").resolve(m.group(1)));
                }
            } catch (IOException e) {
                // An unreadable snapshot: its load reports it; the changelogs are still worth filling.
            }
        }
        for (long v : changelogs.tailSet(snapshot, false)) {
            out.add(store.resolve(v + ".changelog"));
        }
        return out;
    }

    private static String metadata(Path zip) throws IOException {
        try (ZipFile z = new ZipFile(zip.toFile())) {
            ZipEntry entry = z.getEntry("metadata");
            if (entry == null) {
                throw new IOException(zip + " has no metadata entry");
            }
            try (InputStream in = z.getInputStream(entry)) {
                return new String(in.readAllBytes(), StandardCharsets.UTF_8);
            }
        }
    }
}
