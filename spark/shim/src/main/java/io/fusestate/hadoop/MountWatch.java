package io.fusestate.hadoop;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;

import org.apache.spark.TaskFailedReason;
import org.apache.spark.api.plugin.DriverPlugin;
import org.apache.spark.api.plugin.ExecutorPlugin;
import org.apache.spark.api.plugin.PluginContext;
import org.apache.spark.api.plugin.SparkPlugin;

/**
 * A Spark plugin ({@code spark.plugins=io.fusestate.hadoop.MountWatch}) that ends an executor
 * at once when the fusestate mount holding its local dirs dies.
 *
 * <p>A fusestate daemon that dies (an OOM kill, a crash) leaves its mount in place, and every use
 * of it fails with ENOTCONN. The node lives on, so Spark keeps giving its executor tasks, each
 * fails on the dead mount within milliseconds, and after {@code spark.task.maxFailures} tries of
 * one task the job, and the streaming query with it, fails. An executor that exits instead is a
 * lost executor: Spark runs its tasks elsewhere and loads its state stores on other executors, as
 * for a lost node. A replacement executor started once the daemon is back (a pod bound to the new
 * mount) takes its place.
 *
 * <p>The executor asks the mount with statfs, which the kernel never answers from a cache, every
 * {@code spark.fusestate.mountWatch.intervalMs} (500) milliseconds and at once when a task fails
 * on a dead mount. A mount that is merely slow is not dead: only an error ends the executor. The
 * driver is never ended (in local mode the executor is the driver: the pipeline there names the
 * dead mount and restarts the query itself).
 */
public class MountWatch implements SparkPlugin {
    /** The executor's exit status when its mount died. */
    public static final int EXIT_STATUS = 75;
    static final String[] DEAD = {"Transport endpoint is not connected", "Software caused connection abort"};

    @Override
    public DriverPlugin driverPlugin() {
        return null;
    }

    @Override
    public ExecutorPlugin executorPlugin() {
        return new Watch();
    }

    /** The fusestate mounts holding a comma-separated list of local dirs (each once). */
    static List<String> mountsOf(String localDirs) {
        List<String> mounts = new ArrayList<>();
        for (String dir : localDirs.split(",")) {
            if (dir.trim().isEmpty()) {
                continue;
            }
            String mount = FusestateFileSystem.fusestateMountOf(Paths.get(dir.trim()).toAbsolutePath().normalize());
            if (mount != null && !mounts.contains(mount)) {
                mounts.add(mount);
            }
        }
        return mounts;
    }

    /** Why the mount does not answer (its daemon died), or null when it does. */
    static String unanswered(String mount) {
        try {
            Files.getFileStore(Paths.get(mount)).getTotalSpace();
            return null;
        } catch (IOException e) {
            String message = String.valueOf(e.getMessage());
            for (String dead : DEAD) {
                if (message.contains(dead)) {
                    return dead;
                }
            }
            return null; // another error is not a dead daemon
        }
    }

    static final class Watch implements ExecutorPlugin {
        private List<String> mounts = Collections.emptyList();
        private String executor = "?";
        private String where = "";
        private ScheduledExecutorService timer;

        @Override
        public void init(PluginContext ctx, Map<String, String> extraConf) {
            try {
                watch(ctx);
            } catch (RuntimeException | LinkageError e) {
                // Never the reason an executor does not start: it only runs unwatched.
                System.err.println("fusestate: the mount watch is off on this executor: " + e);
            }
        }

        private void watch(PluginContext ctx) {
            executor = ctx.executorID();
            if ("driver".equals(executor)) {
                return;
            }
            where = " on " + host();
            String env = System.getenv("SPARK_LOCAL_DIRS");
            String dirs = env != null && !env.isEmpty() ? env
                    : ctx.conf().get("spark.local.dir", System.getProperty("java.io.tmpdir"));
            mounts = mountsOf(dirs);
            if (mounts.isEmpty()) {
                return;
            }
            long interval = ctx.conf().getLong("spark.fusestate.mountWatch.intervalMs", 500L);
            timer = DaemonTimer.named("fusestate-mount-watch");
            timer.scheduleWithFixedDelay(this::check, interval, interval, TimeUnit.MILLISECONDS);
        }

        /** This executor's host. (PluginContext.hostname() fails on an executor, whose RPC
         *  environment has no address of its own.) */
        private static String host() {
            String ip = System.getenv("SPARK_LOCAL_IP");
            if (ip != null && !ip.isEmpty()) {
                return ip;
            }
            try {
                return java.net.InetAddress.getLocalHost().getHostName();
            } catch (java.io.IOException e) {
                return "this node";
            }
        }

        @Override
        public void onTaskFailed(TaskFailedReason failureReason) {
            String text = String.valueOf(failureReason.toErrorString());
            for (String dead : DEAD) {
                if (text.contains(dead)) {
                    check();
                    return;
                }
            }
        }

        @Override
        public void shutdown() {
            if (timer != null) {
                timer.shutdownNow();
            }
        }

        private void check() {
            for (String mount : mounts) {
                String dead = unanswered(mount);
                if (dead != null) {
                    System.err.println("fusestate: the fusestate mount " + mount + where + ", holding the local dirs "
                            + "of executor " + executor + ", does not answer (" + dead + "): its daemon died; the "
                            + "executor exits so that Spark runs its tasks and loads its state stores elsewhere");
                    System.err.flush();
                    // halt, not exit: shutdown hooks would only touch the dead mount.
                    Runtime.getRuntime().halt(EXIT_STATUS);
                }
            }
        }
    }
}
