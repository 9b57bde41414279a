package io.fusestate.hadoop;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.net.StandardProtocolFamily;
import java.net.UnixDomainSocketAddress;
import java.nio.ByteBuffer;
import java.nio.channels.SocketChannel;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.List;

/**
 * The control socket of the fusestate daemon serving a mount: where it is (the same rule as the
 * daemon's {@code fusestate.daemon.paths.control_socket}) and one request on it, a JSON line
 * answered by a JSON line.
 */
final class DaemonSocket {
    private DaemonSocket() {
    }

    /** The daemon's runtime directory, as the daemon finds it in the same environment. */
    static Path runtimeDir() {
        String explicit = System.getenv("FUSESTATE_RUNTIME_DIR");
        if (explicit != null && !explicit.isEmpty()) {
            return Paths.get(explicit);
        }
        int uid;
        try {
            uid = (Integer) Files.getAttribute(Paths.get("/proc/self"), "unix:uid");
        } catch (IOException | UnsupportedOperationException e) {
            uid = -1;
        }
        if (uid == 0) {
            return Paths.get("/run/fusestate");
        }
        String xdg = System.getenv("XDG_RUNTIME_DIR");
        return xdg != null && !xdg.isEmpty() ? Paths.get(xdg, "fusestate") : Paths.get("/tmp/fusestate-" + uid);
    }

    /** The control socket of the daemon serving {@code mountpoint}. */
    static Path of(String mountpoint) throws IOException {
        String real = Paths.get(mountpoint).toRealPath().toString();
        try {
            byte[] digest = MessageDigest.getInstance("SHA-256").digest(real.getBytes(StandardCharsets.UTF_8));
            StringBuilder hex = new StringBuilder();
            for (int i = 0; i < 10; i++) {
                hex.append(String.format("%02x", digest[i]));
            }
            return runtimeDir().resolve(hex + ".sock");
        } catch (NoSuchAlgorithmException e) {
            throw new IOException(e);
        }
    }

    /** Asks the daemon to fill files (by inode, looked up through the mount) into the page cache;
     *  returns its answer line. */
    static String fill(String mountpoint, List<Long> inodes) throws IOException {
        StringBuilder json = new StringBuilder("{\"command\": \"fill\", \"inodes\": [");
        for (int i = 0; i < inodes.size(); i++) {
            json.append(i == 0 ? "" : ", ").append(inodes.get(i));
        }
        json.append("]}\n");
        return request(of(mountpoint), json.toString());
    }

    static String request(Path socket, String line) throws IOException {
        try (SocketChannel channel = SocketChannel.open(StandardProtocolFamily.UNIX)) {
            channel.connect(UnixDomainSocketAddress.of(socket));
            ByteBuffer out = ByteBuffer.wrap(line.getBytes(StandardCharsets.UTF_8));
            while (out.hasRemaining()) {
                channel.write(out);
            }
            ByteArrayOutputStream answer = new ByteArrayOutputStream();
            ByteBuffer in = ByteBuffer.allocate(65536);
            while (channel.read(in) > 0) {
                in.flip();
                byte[] chunk = new byte[in.remaining()];
                in.get(chunk);
                answer.write(chunk);
                in.clear();
                if (chunk.length > 0 && chunk[chunk.length - 1] == '\n') {
                    break;
                }
            }
            return answer.toString(StandardCharsets.UTF_8).trim();
        }
    }
}
