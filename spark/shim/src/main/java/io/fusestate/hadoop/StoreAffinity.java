package io.fusestate.hadoop;

import java.io.IOException;
import java.io.Serializable;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.nio.file.DirectoryStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.attribute.UserDefinedFileAttributeView;
import java.util.ArrayList;
import java.util.Collections;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.TreeSet;
import java.util.UUID;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;

import org.apache.spark.SparkContext;
import org.apache.spark.SparkEnv;
import org.apache.spark.api.plugin.DriverPlugin;
import org.apache.spark.api.plugin.ExecutorPlugin;
import org.apache.spark.api.plugin.PluginContext;
import org.apache.spark.api.plugin.SparkPlugin;
import org.apache.spark.scheduler.SparkListener;
import org.apache.spark.scheduler.SparkListenerExecutorAdded;
import org.apache.spark.scheduler.SparkListenerExecutorRemoved;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.execution.streaming.state.StateStoreCoordinatorRef;
import org.apache.spark.sql.execution.streaming.state.StateStoreId;
import org.apache.spark.sql.execution.streaming.state.StateStoreProviderId;
import org.apache.spark.sql.streaming.StreamingQuery;
import org.apache.spark.sql.streaming.StreamingQueryListener;

/**
 * Puts each state store of a query that (re)starts on the node whose fusestate cache holds its
 * files, so that a job restarted on the nodes it ran on reads its state from their caches rather
 * than from the bucket.
 *
 * <p>Spark places a state store's task where the store was last loaded, as its
 * {@code StateStoreCoordinator} recorded; a new run of a query starts with no record, and its
 * first batch puts each store wherever a task slot is free. Two parts change that:
 * <ul>
 * <li>this plugin ({@code spark.plugins=io.fusestate.hadoop.StoreAffinity}): on every executor, a
 * poll of the driver every {@code spark.fusestate.affinity.intervalMs} (250) milliseconds; asked
 * about a checkpoint, the executor lists its state stores and asks its node's daemon, through the
 * mount, which files of each store's next load ({@link LatestSnapshot}) it holds (the
 * {@code user.fusestate.warm} attribute), and answers with their bytes for each store it holds
 * at least half of;</li>
 * <li>{@link Listener} ({@code spark.sql.streaming.streamingQueryListeners}), told of a query's
 * start before its first batch is planned: it asks every executor and waits for their answers
 * (at most {@code spark.fusestate.affinity.waitMs}, 5000; 0 turns this off), then records each
 * store with the coordinator as loaded on an executor of the node that holds most of its bytes,
 * spreading stores held as much on several nodes evenly.</li>
 * </ul>
 * A store no node holds goes where Spark puts it. The wait happens only when the checkpoint has
 * state on a fusestate mount, and never in local mode (one node). Nothing here is ever the reason a query or an executor fails: an
 * error only logs one line.
 */
public class StoreAffinity implements SparkPlugin {
    static final String ATTRIBUTE = "fusestate.warm"; // Java adds the "user." namespace

    /** The driver's half, for the listener the session builds in the same JVM. */
    private static volatile Driver driver;

    @Override
    public DriverPlugin driverPlugin() {
        return new Driver();
    }

    @Override
    public ExecutorPlugin executorPlugin() {
        return new Asker();
    }

    /** The driver's question: how much of each store under this state directory (a local path
     *  on the mount, the same on every node) does your node hold? */
    static final class Request implements Serializable {
        private static final long serialVersionUID = 1L;
        final long seq;
        final String stateDir;

        Request(long seq, String stateDir) {
            this.seq = seq;
            this.stateDir = stateDir;
        }
    }

    /** An executor asking for a question newer than the last one it answered. */
    static final class Poll implements Serializable {
        private static final long serialVersionUID = 1L;
        final long answered;

        Poll(long answered) {
            this.answered = answered;
        }
    }

    /** An executor's answer: the bytes of each store's next load its node holds, by store
     *  ({@code <operator>/<partition>[/<store>]}); stores it holds nothing of are left out. */
    static final class Warm implements Serializable {
        private static final long serialVersionUID = 1L;
        final long seq;
        final String executor;
        final Map<String, Long> stores;

        Warm(long seq, String executor, Map<String, Long> stores) {
            this.seq = seq;
            this.executor = executor;
            this.stores = stores;
        }
    }

    static final class Driver implements DriverPlugin {
        private final TreeSet<String> alive = new TreeSet<>(); // under this object's lock
        private final Map<String, String> hosts = new HashMap<>(); // executor -> its host, as Spark knows it
        private Request current;
        private final Map<String, Warm> answers = new HashMap<>();
        private long seq;
        long waitMs = 5000L;

        @Override
        public Map<String, String> init(SparkContext sc, PluginContext ctx) {
            waitMs = sc.conf().getLong("spark.fusestate.affinity.waitMs", 5000L);
            if (sc.isLocal()) {
                return Collections.emptyMap(); // one node: nothing to choose
            }
            sc.addSparkListener(new SparkListener() {
                @Override
                public void onExecutorAdded(SparkListenerExecutorAdded added) {
                    if ("driver".equals(added.executorId())) {
                        return;
                    }
                    synchronized (Driver.this) {
                        alive.add(added.executorId());
                        hosts.put(added.executorId(), added.executorInfo().executorHost());
                        Driver.this.notifyAll();
                    }
                }

                @Override
                public void onExecutorRemoved(SparkListenerExecutorRemoved removed) {
                    synchronized (Driver.this) {
                        alive.remove(removed.executorId());
                        hosts.remove(removed.executorId());
                        Driver.this.notifyAll();
                    }
                }
            });
            driver = this;
            return Collections.emptyMap();
        }

        @Override
        public void shutdown() {
            driver = null;
        }

        @Override
        public synchronized Object receive(Object message) {
            if (message instanceof Poll) {
                return current != null && current.seq > ((Poll) message).answered ? current : null;
            }
            if (message instanceof Warm) {
                Warm w = (Warm) message;
                if (current != null && w.seq == current.seq) {
                    answers.put(w.executor, w);
                    notifyAll();
                }
            }
            return null;
        }

        /** Asks every executor about {@code stateDir}; returns the answers that came within the
         *  wait, by executor. With no executor yet, waits for the first to register and answer. */
        synchronized Map<String, Warm> ask(String stateDir) throws InterruptedException {
            current = new Request(++seq, stateDir);
            answers.clear();
            long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(waitMs);
            try {
                while (answers.isEmpty() || !answers.keySet().containsAll(alive)) {
                    long left = TimeUnit.NANOSECONDS.toMillis(deadline - System.nanoTime());
                    if (left <= 0) {
                        break;
                    }
                    wait(left);
                }
                return new TreeMap<>(answers);
            } finally {
                current = null;
            }
        }

        synchronized int executors() {
            return alive.size();
        }

        synchronized String hostOf(String executor) {
            return hosts.get(executor);
        }
    }

    /** The listener half: {@code spark.sql.streaming.streamingQueryListeners=io.fusestate.hadoop.StoreAffinity$Listener}.
     *  Spark tells a session's listeners of a query's start on the query's own thread, before its
     *  first batch, so what this records decides where that batch's state tasks go. */
    public static final class Listener extends StreamingQueryListener {
        @Override
        public void onQueryStarted(QueryStartedEvent event) {
            Driver d = driver;
            if (d == null || d.waitMs <= 0) {
                return;
            }
            try {
                place(d, event.id(), event.runId());
            } catch (Exception | LinkageError e) {
                System.err.println("fusestate: could not place the state stores of query " + event.id()
                        + " on the nodes that hold them: " + e);
            }
        }

        @Override
        public void onQueryProgress(QueryProgressEvent event) {
        }

        @Override
        public void onQueryTerminated(QueryTerminatedEvent event) {
        }
    }

    static void place(Driver d, UUID queryId, UUID runId) throws Exception {
        String root = stateRoot(queryId);
        Path dir = root == null ? null : FusestateFileSystem.localPath(new org.apache.hadoop.fs.Path(root));
        if (dir == null || !Files.isDirectory(dir) || FusestateFileSystem.fusestateMountOf(dir) == null) {
            return; // a first start, or a checkpoint not on fusestate
        }
        List<String> stores = storeDirs(dir);
        if (stores.isEmpty()) {
            return;
        }
        long started = System.nanoTime();
        Map<String, Warm> answers = d.ask(dir.toString());
        long waited = TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - started);
        Map<String, Warm> chosen = choose(stores, answers.values());
        StateStoreCoordinatorRef coordinator = StateStoreCoordinatorRef.forExecutor(SparkEnv.get());
        scala.collection.immutable.Seq<StateStoreProviderId> none =
                scala.jdk.javaapi.CollectionConverters.asScala(new ArrayList<StateStoreProviderId>()).toList();
        int placed = 0;
        for (Map.Entry<String, Warm> e : chosen.entrySet()) {
            String host = d.hostOf(e.getValue().executor);
            if (host == null) {
                continue; // removed since it answered
            }
            String[] part = e.getKey().split("/");
            String name = part.length > 2 ? part[2] : StateStoreId.DEFAULT_STORE_NAME();
            StateStoreId id = new StateStoreId(root, Long.parseLong(part[0]), Integer.parseInt(part[1]), name);
            coordinator.reportActiveInstance(new StateStoreProviderId(id, runId), host, e.getValue().executor, none);
            placed++;
        }
        System.err.println("fusestate: " + placed + " of " + stores.size() + " state stores of query " + queryId
                + " start on a node that holds them (" + answers.size() + " of " + d.executors()
                + " executors answered in " + waited + " ms)");
    }

    /** Each store some executor's node holds bytes of, to the executor whose node holds the
     *  most; among equals (executors of one node, or copies on several), the one given the
     *  fewest stores so far, so that they spread evenly. */
    static Map<String, Warm> choose(List<String> stores, Iterable<Warm> answers) {
        Map<String, List<Warm>> holders = new HashMap<>();
        for (Warm w : answers) {
            for (String s : w.stores.keySet()) {
                holders.computeIfAbsent(s, k -> new ArrayList<>()).add(w);
            }
        }
        Map<String, Integer> load = new HashMap<>();
        Map<String, Warm> chosen = new TreeMap<>();
        for (String s : stores) {
            Warm best = null;
            for (Warm w : holders.getOrDefault(s, Collections.emptyList())) {
                int more = best == null ? 1 : Long.compare(w.stores.get(s), best.stores.get(s));
                if (more > 0 || more == 0 && load.getOrDefault(w.executor, 0) < load.getOrDefault(best.executor, 0)) {
                    best = w;
                }
            }
            if (best != null) {
                chosen.put(s, best);
                load.merge(best.executor, 1, Integer::sum);
            }
        }
        return chosen;
    }

    /** Where Spark keeps the query's state: {@code <checkpoint root>/state}, as it names it. */
    static String stateRoot(UUID queryId) throws ReflectiveOperationException {
        scala.Option<SparkSession> session = SparkSession.getActiveSession();
        if (session.isEmpty()) {
            session = SparkSession.getDefaultSession();
        }
        if (session.isEmpty()) {
            return null;
        }
        StreamingQuery query = session.get().streams().get(queryId);
        if (query == null) {
            return null;
        }
        Object execution = query.getClass().getMethod("streamingQuery").invoke(query);
        return (String) execution.getClass().getMethod("checkpointFile", String.class).invoke(execution, "state");
    }

    /** The state stores under a state directory: {@code <operator>/<partition>} for an operator's
     *  default store, {@code <operator>/<partition>/<name>} for a named one (a join's). */
    static List<String> storeDirs(Path stateDir) throws IOException {
        List<String> out = new ArrayList<>();
        for (Path op : numbered(stateDir)) {
            for (Path part : numbered(op)) {
                boolean files = false;
                try (DirectoryStream<Path> entries = Files.newDirectoryStream(part)) {
                    for (Path e : entries) {
                        String n = e.getFileName().toString();
                        if (!Files.isDirectory(e) || n.equals("SSTs") || n.equals("logs")) {
                            files = true;
                        } else if (!n.startsWith("_") && !n.startsWith(".")) {
                            out.add(op.getFileName() + "/" + part.getFileName() + "/" + n);
                        }
                    }
                }
                if (files) {
                    out.add(op.getFileName() + "/" + part.getFileName());
                }
            }
        }
        Collections.sort(out);
        return out;
    }

    private static List<Path> numbered(Path dir) throws IOException {
        List<Path> out = new ArrayList<>();
        try (DirectoryStream<Path> entries = Files.newDirectoryStream(dir)) {
            for (Path e : entries) {
                if (e.getFileName().toString().matches("[0-9]+") && Files.isDirectory(e)) {
                    out.add(e);
                }
            }
        }
        return out;
    }

    /** The bytes of a store's next load whose files this node holds (at least half of each), or
     *  0 when that is less than half of the load's bytes: a store this node does not hold. */
    static long warmBytes(Path store) throws IOException {
        long warm = 0;
        long total = 0;
        for (Path f : LatestSnapshot.files(store)) {
            try {
                long size = Files.size(f);
                total += size;
                if (warmHere(f)) {
                    warm += size;
                }
            } catch (IOException e) {
                // deleted since the listing (maintenance)
            }
        }
        return 2 * warm >= total ? warm : 0;
    }

    /** Whether this node's daemon holds at least half of a file's bytes: it answers the setting
     *  of {@code user.fusestate.warm} with success, or with ENODATA when not. */
    static boolean warmHere(Path file) {
        try {
            UserDefinedFileAttributeView view = Files.getFileAttributeView(file, UserDefinedFileAttributeView.class);
            if (view == null) {
                return false;
            }
            view.write(ATTRIBUTE, ByteBuffer.wrap(new byte[0]));
            return true;
        } catch (IOException e) {
            return false;
        }
    }

    static final class Asker implements ExecutorPlugin {
        private PluginContext ctx;
        private String executor = "?";
        private long answered;
        private boolean quiet;
        private ScheduledExecutorService timer;

        @Override
        public void init(PluginContext ctx, Map<String, String> extraConf) {
            try {
                this.ctx = ctx;
                executor = ctx.executorID();
                if ("driver".equals(executor) || ctx.conf().getLong("spark.fusestate.affinity.waitMs", 5000L) <= 0) {
                    return; // local mode: one node; or turned off
                }
                long interval = ctx.conf().getLong("spark.fusestate.affinity.intervalMs", 250L);
                timer = DaemonTimer.named("fusestate-store-affinity");
                timer.scheduleWithFixedDelay(this::poll, 0, interval, TimeUnit.MILLISECONDS);
            } catch (RuntimeException | LinkageError e) {
                System.err.println("fusestate: state store affinity is off on this executor: " + e);
            }
        }

        @Override
        public void shutdown() {
            if (timer != null) {
                timer.shutdownNow();
            }
        }

        private void poll() {
            try {
                Request r = (Request) ctx.ask(new Poll(answered));
                if (r == null) {
                    return;
                }
                Map<String, Long> warm = new HashMap<>();
                Path dir = Paths.get(r.stateDir);
                for (String store : storeDirs(dir)) {
                    long bytes = warmBytes(dir.resolve(store));
                    if (bytes > 0) {
                        warm.put(store, bytes);
                    }
                }
                ctx.send(new Warm(r.seq, executor, warm));
                answered = r.seq;
            } catch (Exception | LinkageError e) {
                if (!quiet) {
                    quiet = true; // once: a driver that does not answer says so in its own log
                    System.err.println("fusestate: executor " + executor + " could not tell the driver which state "
                            + "stores its node holds (" + e + "); it goes on asking");
                }
            }
        }
    }
}
