package io.fusestate.hadoop;

import java.io.BufferedReader;
import java.io.File;
import java.io.FileNotFoundException;
import java.io.IOException;
import java.net.URI;
import java.nio.channels.FileChannel;
import java.nio.charset.StandardCharsets;
import java.nio.file.FileAlreadyExistsException;
import java.nio.file.Files;
import java.nio.file.LinkOption;
import java.nio.file.NoSuchFileException;
import java.nio.file.Paths;
import java.nio.file.StandardOpenOption;
import java.nio.file.attribute.PosixFileAttributes;
import java.nio.file.attribute.PosixFilePermissions;
import java.util.concurrent.atomic.AtomicLong;

import org.apache.commons.logging.Log;
import org.apache.commons.logging.LogFactory;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FSLinkResolver;
import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsPermission;

/**
 * A local file system for paths on a fusestate mount, under the {@code fusestate://} scheme.
 *
 * <p>{@code fusestate:///mnt/state/x} is the local path {@code /mnt/state/x}; every operation is
 * the one of {@link RawLocalFileSystem}, except the two copies the RocksDB state store of Spark
 * uses to move SST files between its working directory and the checkpoint location:
 * {@link #copyFromLocalFile(boolean, boolean, Path, Path)} and
 * {@link #copyToLocalFile(boolean, Path, Path, boolean)}. When both ends are on the same fusestate
 * mount they create a hard link (metadata only, no data read or written) instead of a copy.
 * In every other case, and whenever linking fails, they fall back to the ordinary copy.
 *
 * <p>SST files are immutable once written, so sharing one inode between the working directory and
 * the checkpoint is safe: RocksDB only ever creates and deletes them.
 *
 * <p>A rename onto a fusestate mount is also a durability barrier: Spark writes every checkpoint
 * file (offsets, commits, the state store's metadata) to a temporary name and renames it, and
 * never syncs it. After the rename this fsyncs the target's directory, which fusestate answers
 * once the rename and everything before it is as durable as the mount's {@code --durability}
 * says. A batch Spark has recorded as committed then survives the loss of the node.
 *
 * <p>Without Hadoop's native library (PySpark ships none), {@link RawLocalFileSystem} starts a
 * process for two calls Spark makes on every state store commit: {@code chmod} to set a new
 * file's or directory's permission, and {@code readlink} for a file's link status (the
 * FileContext rename of every checkpoint file asks for it), and {@code ls} for the owner and
 * permission of any status (which then fails on a {@code fusestate://} path). A small state's
 * commits started about a hundred such processes per micro-batch, 8-9 ms each on the 2-core
 * test machine. Here all of them are system calls through java.nio.
 */
public class FusestateFileSystem extends RawLocalFileSystem {
    public static final String SCHEME = "fusestate";
    private static final Log LOG = LogFactory.getLog(FusestateFileSystem.class);

    /** Counters, for tests and logs: how many copies became links, how many were real copies. */
    public static final AtomicLong LINKED = new AtomicLong();
    public static final AtomicLong COPIED = new AtomicLong();
    /** Renames followed by a directory fsync (durability barriers). */
    public static final AtomicLong SYNCED = new AtomicLong();
    /** Renames without overwrite made atomic with a link (see {@link #renameNoReplace}). */
    public static final AtomicLong RENAMED_NO_REPLACE = new AtomicLong();

    // Static: RawLocalFileSystem's constructor already asks for the URI (working directory).
    /** Copies turned into hard links in this JVM. */
    public static long linkedCount() {
        return LINKED.get();
    }

    /** Copies made the ordinary way in this JVM. */
    public static long copiedCount() {
        return COPIED.get();
    }

    /** Renames on a fusestate mount made durable in this JVM. */
    public static long syncedCount() {
        return SYNCED.get();
    }

    /** No-overwrite renames made with link and unlink in this JVM. */
    public static long renamedNoReplaceCount() {
        return RENAMED_NO_REPLACE.get();
    }

    private static final URI URI_ROOT = URI.create(SCHEME + ":///");

    @Override
    public String getScheme() {
        return SCHEME;
    }

    @Override
    public URI getUri() {
        return URI_ROOT;
    }

    @Override
    public void initialize(URI name, Configuration conf) throws IOException {
        super.initialize(name, conf);
    }

    /** The local path a Hadoop path of either scheme (fusestate, file, none) stands for. */
    static java.nio.file.Path localPath(Path p) {
        URI u = p.toUri();
        String scheme = u.getScheme();
        if (scheme != null && !scheme.equals(SCHEME) && !scheme.equals("file")) {
            return null;
        }
        return Paths.get(u.getPath()).toAbsolutePath().normalize();
    }

    /**
     * The mountpoint of the fusestate mount holding {@code p} (the longest mount prefix in
     * /proc/self/mounts), or null when that mount is not a fusestate mount.
     */
    static String fusestateMountOf(java.nio.file.Path p) {
        String path = p.toString();
        String best = null;
        String bestType = null;
        try (BufferedReader r = Files.newBufferedReader(Paths.get("/proc/self/mounts"), StandardCharsets.UTF_8)) {
            String line;
            while ((line = r.readLine()) != null) {
                String[] f = line.split(" ");
                if (f.length < 3) {
                    continue;
                }
                String mp = unescape(f[1]);
                boolean under = path.equals(mp) || mp.equals("/")
                        || path.startsWith(mp.endsWith("/") ? mp : mp + "/");
                if (under && (best == null || mp.length() >= best.length())) {
                    best = mp;
                    bestType = f[2];
                }
            }
        } catch (IOException e) {
            return null;
        }
        if (bestType != null && bestType.startsWith("fuse.fusestate")) {
            return best;
        }
        return null;
    }

    private static String unescape(String s) {
        // /proc/self/mounts escapes space, tab, newline and backslash as octal.
        return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\");
    }

    /** The nearest existing ancestor of p (p itself if it exists). */
    private static java.nio.file.Path existing(java.nio.file.Path p) {
        java.nio.file.Path q = p;
        while (q != null && !Files.exists(q, LinkOption.NOFOLLOW_LINKS)) {
            q = q.getParent();
        }
        return q;
    }

    /** True when src and dst are on one and the same fusestate mount. */
    static boolean sameFusestateMount(java.nio.file.Path src, java.nio.file.Path dst) {
        java.nio.file.Path s = existing(src);
        java.nio.file.Path d = existing(dst);
        if (s == null || d == null) {
            return false;
        }
        String ms = fusestateMountOf(s);
        String md = fusestateMountOf(d);
        if (ms == null || !ms.equals(md)) {
            return false;
        }
        try {
            Object ds = Files.getAttribute(s, "unix:dev");
            Object dd = Files.getAttribute(d, "unix:dev");
            return ds.equals(dd);
        } catch (IOException | UnsupportedOperationException | IllegalArgumentException e) {
            return true; // the mount table already says so
        }
    }

    /**
     * Hard-link the regular file src as dst, replacing dst when overwrite. Returns false (and
     * leaves dst as it was, unless it was to be replaced) when a link cannot be made.
     */
    static boolean tryLink(java.nio.file.Path src, java.nio.file.Path dst, boolean overwrite) {
        if (src == null || dst == null || !Files.isRegularFile(src, LinkOption.NOFOLLOW_LINKS)) {
            return false;
        }
        if (!sameFusestateMount(src, dst)) {
            return false;
        }
        try {
            if (Files.isDirectory(dst)) {
                dst = dst.resolve(src.getFileName());
            }
            java.nio.file.Path parent = dst.getParent();
            if (parent != null) {
                Files.createDirectories(parent);
            }
            if (Files.exists(dst, LinkOption.NOFOLLOW_LINKS)) {
                if (Files.isSameFile(src, dst)) {
                    return true;
                }
                if (!overwrite) {
                    return false; // let the normal path raise its usual error
                }
                Files.delete(dst);
            }
            Files.createLink(dst, src);
            return true;
        } catch (FileAlreadyExistsException e) {
            return false;
        } catch (IOException | UnsupportedOperationException | SecurityException e) {
            LOG.warn("fusestate: hard link " + src + " -> " + dst + " failed, copying instead: " + e);
            return false;
        }
    }

    @Override
    public boolean rename(Path src, Path dst) throws IOException {
        boolean renamed = super.rename(src, dst);
        java.nio.file.Path d = localPath(dst);
        if (renamed && d != null && d.getParent() != null && fusestateMountOf(d.getParent()) != null) {
            syncDirectory(d.getParent());
            SYNCED.incrementAndGet();
        }
        return renamed;
    }

    /**
     * Rename the regular file src to dst only if dst does not exist, atomically for every node
     * of a shared volume: link(2) creates dst or fails with EEXIST in one step (one transaction
     * of the volume's metadata engine), then src is removed. Java has no renameat2; a check
     * followed by rename(2), which Hadoop's local file system does, lets two nodes both
     * "win" (Spark's offset and commit logs rely on the loser failing). Returns false when
     * this cannot be done with a link (not a regular file, not on a fusestate mount), for the
     * caller's ordinary rename.
     *
     * @throws org.apache.hadoop.fs.FileAlreadyExistsException when dst exists
     */
    static boolean renameNoReplace(java.nio.file.Path src, java.nio.file.Path dst) throws IOException {
        if (src == null || dst == null || dst.getParent() == null
                || !Files.isRegularFile(src, LinkOption.NOFOLLOW_LINKS) || !sameFusestateMount(src, dst)) {
            return false;
        }
        try {
            Files.createLink(dst, src);
        } catch (FileAlreadyExistsException e) {
            throw new org.apache.hadoop.fs.FileAlreadyExistsException("rename destination " + dst + " already exists.");
        } catch (NoSuchFileException e) {
            throw new FileNotFoundException("rename source " + src + " or destination directory does not exist");
        }
        Files.delete(src);
        syncDirectory(dst.getParent());
        SYNCED.incrementAndGet();
        RENAMED_NO_REPLACE.incrementAndGet();
        return true;
    }

    /** fsync a directory (Linux lets a read-only channel on a directory be forced). */
    static void syncDirectory(java.nio.file.Path dir) throws IOException {
        try (FileChannel channel = FileChannel.open(dir, StandardOpenOption.READ)) {
            channel.force(true);
        }
    }

    @Override
    public void setPermission(Path p, FsPermission permission) throws IOException {
        java.nio.file.Path local = localPath(p);
        if (local == null || permission.getStickyBit()) {
            super.setPermission(p, permission); // chmod(1) knows the sticky bit
            return;
        }
        try {
            // FsPermission prints rwx triplets, the form PosixFilePermissions parses.
            Files.setPosixFilePermissions(local, PosixFilePermissions.fromString(permission.toString()));
        } catch (NoSuchFileException e) {
            throw new FileNotFoundException("File " + p + " does not exist");
        } catch (UnsupportedOperationException e) {
            super.setPermission(p, permission);
        }
    }

    @Override
    public FileStatus getFileStatus(Path f) throws IOException {
        FileStatus s = status(f, true);
        return s != null ? s : super.getFileStatus(f);
    }

    @Override
    public FileStatus getFileLinkStatus(Path f) throws IOException {
        FileStatus s = status(f, false);
        return s != null ? s : super.getFileLinkStatus(f);
    }

    /**
     * A file's status from one stat(2), owner and permission included: Hadoop's own status of a
     * local file runs ls(1) for those, and fails on a fusestate:// path when asked. Null where
     * java.nio cannot tell (another scheme, no POSIX attributes).
     */
    private FileStatus status(Path f, boolean followLinks) throws IOException {
        java.nio.file.Path local = localPath(f);
        if (local == null) {
            return null;
        }
        PosixFileAttributes a;
        try {
            a = followLinks ? Files.readAttributes(local, PosixFileAttributes.class)
                    : Files.readAttributes(local, PosixFileAttributes.class, LinkOption.NOFOLLOW_LINKS);
        } catch (NoSuchFileException e) {
            throw new FileNotFoundException("File " + f + " does not exist");
        } catch (UnsupportedOperationException e) {
            return null;
        }
        Path qualified = f.makeQualified(getUri(), getWorkingDirectory());
        Path target = null;
        if (a.isSymbolicLink()) {
            target = FSLinkResolver.qualifySymlinkTarget(getUri(), qualified,
                    new Path(Files.readSymbolicLink(local).toString()));
        }
        return new FileStatus(a.size(), a.isDirectory(), 1, getDefaultBlockSize(f),
                a.lastModifiedTime().toMillis(), a.lastAccessTime().toMillis(),
                FsPermission.valueOf("-" + PosixFilePermissions.toString(a.permissions())), a.owner().getName(), a.group().getName(),
                target, qualified);
    }

    @Override
    public void copyFromLocalFile(boolean delSrc, boolean overwrite, Path src, Path dst) throws IOException {
        java.nio.file.Path s = localPath(src);
        java.nio.file.Path d = localPath(dst);
        HeldStores.noteCheckpointFile(d);
        if (tryLink(s, d, overwrite)) {
            LINKED.incrementAndGet();
            if (delSrc) {
                Files.deleteIfExists(s);
            }
            return;
        }
        COPIED.incrementAndGet();
        super.copyFromLocalFile(delSrc, overwrite, src, dst);
    }

    @Override
    public void copyToLocalFile(boolean delSrc, Path src, Path dst, boolean useRawLocalFileSystem) throws IOException {
        java.nio.file.Path s = localPath(src);
        java.nio.file.Path d = localPath(dst);
        HeldStores.noteCheckpointFile(s);
        if (tryLink(s, d, true)) {
            LINKED.incrementAndGet();
            if (delSrc) {
                Files.deleteIfExists(s);
            }
            return;
        }
        COPIED.incrementAndGet();
        super.copyToLocalFile(delSrc, src, dst, useRawLocalFileSystem);
    }

    @Override
    public String toString() {
        return "FusestateFileSystem";
    }

    /** For a quick manual check: prints whether two paths would be linked. */
    public static void main(String[] args) {
        if (args.length != 2) {
            System.err.println("usage: FusestateFileSystem SRC DST");
            System.exit(2);
        }
        java.nio.file.Path s = new File(args[0]).toPath().toAbsolutePath().normalize();
        java.nio.file.Path d = new File(args[1]).toPath().toAbsolutePath().normalize();
        System.out.println(sameFusestateMount(s, d) ? "link" : "copy");
    }
}
