package io.fusestate.hadoop;

import java.io.IOException;
import java.io.Serializable;
import java.nio.channels.FileChannel;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.StandardOpenOption;
import java.util.ArrayList;
import java.util.Collection;
import java.util.Collections;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeSet;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;

import org.apache.spark.SparkContext;
import org.apache.spark.api.plugin.DriverPlugin;
import org.apache.spark.api.plugin.ExecutorPlugin;
import org.apache.spark.api.plugin.PluginContext;
import org.apache.spark.api.plugin.SparkPlugin;
import org.apache.spark.scheduler.SparkListener;
import org.apache.spark.scheduler.SparkListenerExecutorAdded;
import org.apache.spark.scheduler.SparkListenerExecutorRemoved;

/**
 * A Spark plugin ({@code spark.plugins=io.fusestate.hadoop.LossFill}) that puts a lost
 * executor's state stores into the page cache of the executors left, as soon as Spark notices
 * the loss, rather than one store at a time as each store's task loads it.
 *
 * <p>After a loss, the batch that was running runs again, and its tasks for the lost stores go
 * to whichever executors have a free slot, one task per slot at a time. Each task's load links
 * the store's latest snapshot, and its reads then fetch it from the bucket: the fetch of the
 * lost state is paced by the tasks. Here each executor tells the driver which stores it holds
 * (those whose files the shim linked, {@link HeldStores}); the driver's listener sees an executor
 * removed and keeps its stores as lost; every executor asks the driver every
 * {@code spark.fusestate.lossFill.intervalMs} (500) milliseconds and, after a loss, asks its
 * daemon, through the mount ({@link FillRequest}), to fill each lost store's latest snapshot
 * ({@link LatestSnapshot}), holding the files
 * open for {@code spark.fusestate.lossFill.holdSeconds} (120) so that the kernel keeps their
 * pages until the loads link them. A daemon fills only files the node does not hold already.
 *
 * <p>Every executor left fills every lost store, since which of them will load which store is
 * Spark's choice at each task's start. With many executors left, each loads few of the lost
 * stores and the fill would mostly bring state a node never reads: beyond
 * {@code spark.fusestate.lossFill.maxSurvivors} (4) executors left, none fills. Nothing here is
 * ever the reason a task or an executor fails: an error only logs one line.
 */
public class LossFill implements SparkPlugin {
    @Override
    public DriverPlugin driverPlugin() {
        return new Driver();
    }

    @Override
    public ExecutorPlugin executorPlugin() {
        return new Filler();
    }

    /** An executor's stores: reported by it as they come (new ones only), and kept by the
     *  driver as one loss once the executor is removed. */
    static final class Held implements Serializable {
        private static final long serialVersionUID = 1L;
        final String executor;
        final List<String> stores;

        Held(String executor, Collection<String> stores) {
            this.executor = executor;
            this.stores = new ArrayList<>(stores);
        }
    }

    /** An executor asking for the losses after the first {@code seen}. */
    static final class Poll implements Serializable {
        private static final long serialVersionUID = 1L;
        final int seen;

        Poll(int seen) {
            this.seen = seen;
        }
    }

    /** The driver's answer: the losses after the asked-for ones, how many there are in all and
     *  how many executors are left. */
    static final class Lost implements Serializable {
        private static final long serialVersionUID = 1L;
        final int total;
        final List<Held> losses;
        final int alive;

        Lost(int total, List<Held> losses, int alive) {
            this.total = total;
            this.losses = losses;
            this.alive = alive;
        }
    }

    static final class Driver implements DriverPlugin {
        private final Map<String, Set<String>> held = new HashMap<>(); // under this object's lock
        private final Set<String> alive = ConcurrentHashMap.newKeySet();
        private final List<Held> losses = new ArrayList<>();

        @Override
        public Map<String, String> init(SparkContext sc, PluginContext ctx) {
            sc.addSparkListener(new SparkListener() {
                @Override
                public void onExecutorAdded(SparkListenerExecutorAdded added) {
                    alive.add(added.executorId());
                }

                @Override
                public void onExecutorRemoved(SparkListenerExecutorRemoved removed) {
                    lost(removed.executorId());
                }
            });
            return Collections.emptyMap();
        }

        synchronized void lost(String executor) {
            alive.remove(executor);
            Set<String> stores = held.remove(executor);
            if (stores != null) {
                losses.add(new Held(executor, new TreeSet<>(stores)));
            }
        }

        @Override
        public synchronized Object receive(Object message) {
            if (message instanceof Held) {
                Held h = (Held) message;
                held.computeIfAbsent(h.executor, k -> new HashSet<>()).addAll(h.stores);
                return null;
            }
            if (message instanceof Poll) {
                int from = Math.min(Math.max(((Poll) message).seen, 0), losses.size());
                return new Lost(losses.size(), new ArrayList<>(losses.subList(from, losses.size())), alive.size());
            }
            return null;
        }
    }

    /** What an executor asked its daemon to fill for lost stores. */
    static final class Asked {
        final List<Path> files = new ArrayList<>();
        long bytes;
        String error; // the first refusal (a store not on fusestate is skipped, not refused)
    }

    /** Asks this node's daemon, through the mount ({@link FillRequest}), to fill each store's
     *  latest snapshot ({@link LatestSnapshot}); looks every file up first, so the kernel
     *  knows the inodes the daemon will hand it pages of. */
    static Asked ask(List<String> stores) {
        Asked asked = new Asked();
        for (String store : stores) {
            Path dir = Paths.get(store);
            if (FusestateFileSystem.fusestateMountOf(dir) == null) {
                continue;
            }
            try {
                for (Path f : LatestSnapshot.files(dir)) {
                    try {
                        asked.bytes += Files.size(f);
                        asked.files.add(f);
                    } catch (NoSuchFileException e) {
                        // deleted since the listing (maintenance): nothing to fill
                    }
                }
            } catch (IOException e) {
                System.err.println("fusestate: listing the lost state store " + store + ": " + e);
            }
        }
        try {
            FillRequest.ask(asked.files);
        } catch (IOException e) {
            asked.error = String.valueOf(e);
        }
        return asked;
    }

    static final class Filler implements ExecutorPlugin {
        private PluginContext ctx;
        private String executor = "?";
        private int seen = -1; // the first answer only says where the list stands
        private long holdSeconds;
        private int maxSurvivors;
        private boolean quiet;
        private ScheduledExecutorService timer;
        private final List<FileChannel> holding = Collections.synchronizedList(new ArrayList<>());

        @Override
        public void init(PluginContext ctx, Map<String, String> extraConf) {
            try {
                this.ctx = ctx;
                executor = ctx.executorID();
                if ("driver".equals(executor)) {
                    return; // local mode: nothing to lose
                }
                long interval = ctx.conf().getLong("spark.fusestate.lossFill.intervalMs", 500L);
                holdSeconds = ctx.conf().getLong("spark.fusestate.lossFill.holdSeconds", 120L);
                maxSurvivors = ctx.conf().getInt("spark.fusestate.lossFill.maxSurvivors", 4);
                timer = DaemonTimer.named("fusestate-loss-fill");
                timer.scheduleWithFixedDelay(this::poll, interval, interval, TimeUnit.MILLISECONDS);
            } catch (RuntimeException | LinkageError e) {
                System.err.println("fusestate: the loss fill is off on this executor: " + e);
            }
        }

        @Override
        public void shutdown() {
            if (timer != null) {
                timer.shutdownNow();
            }
            release();
        }

        private void poll() {
            List<String> mine = HeldStores.takeUnreported();
            try {
                if (!mine.isEmpty()) {
                    ctx.send(new Held(executor, mine));
                }
                mine = Collections.emptyList();
                Lost lost = (Lost) ctx.ask(new Poll(seen));
                if (seen >= 0 && !lost.losses.isEmpty()) {
                    fill(lost);
                }
                seen = lost.total;
            } catch (Exception e) {
                HeldStores.putBack(mine);
                if (!quiet) {
                    quiet = true; // once: a driver that does not answer says so in its own log
                    System.err.println("fusestate: executor " + executor + " could not ask the driver about lost "
                            + "executors (" + e + "); it goes on asking");
                }
            }
        }

        private void fill(Lost lost) {
            Set<String> executors = new TreeSet<>();
            List<String> stores = new ArrayList<>();
            for (Held loss : lost.losses) {
                executors.add(loss.executor);
                stores.addAll(loss.stores);
            }
            String who = String.join(", ", executors);
            if (lost.alive > maxSurvivors) {
                System.err.println("fusestate: executor " + who + " lost; " + lost.alive + " executors left (more than "
                        + "spark.fusestate.lossFill.maxSurvivors=" + maxSurvivors + "): its " + stores.size()
                        + " state stores fill as their tasks load them");
                return;
            }
            Asked asked = ask(stores);
            // Held open after the request (the daemon does not fill a file open here) until the
            // loads have linked them: the kernel keeps the pages of inodes something holds.
            List<FileChannel> opened = new ArrayList<>();
            for (Path f : asked.files) {
                try {
                    opened.add(FileChannel.open(f, StandardOpenOption.READ));
                } catch (IOException e) {
                    // deleted meanwhile
                }
            }
            holding.addAll(opened);
            timer.schedule(() -> close(opened), holdSeconds, TimeUnit.SECONDS);
            System.err.println("fusestate: executor " + who + " lost; executor " + executor + " asked its daemon to fill "
                    + asked.files.size() + " files (" + asked.bytes / 1000000 + " MB) of " + stores.size()
                    + " lost state stores" + (asked.error == null ? "" : ", which did not take it: " + asked.error));
        }

        private void close(List<FileChannel> channels) {
            for (FileChannel c : channels) {
                holding.remove(c);
                try {
                    c.close();
                } catch (IOException e) {
                    // closing a read-only file: nothing lost
                }
            }
        }

        private void release() {
            synchronized (holding) {
                close(new ArrayList<>(holding));
            }
        }
    }
}
