package io.fusestate.hadoop;

import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;

/** The one background thread each of the shim's executor plugins polls on: a daemon thread, so
 *  that it never holds a JVM open. */
final class DaemonTimer {
    private DaemonTimer() {
    }

    static ScheduledExecutorService named(String name) {
        return Executors.newSingleThreadScheduledExecutor(r -> {
            Thread t = new Thread(r, name);
            t.setDaemon(true);
            return t;
        });
    }
}
