package io.fusestate.hadoop;

import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;

/**
 * The RocksDB state stores this JVM has loaded or committed: the checkpoint directories
 * ({@code <checkpoint>/state/<operator>/<partition>[/<store>]}) whose SST or log files the shim
 * linked into or out of a working directory.
 *
 * <p>{@link LossFill} reports them to the driver, so that when this executor is lost the
 * executors left know which stores are about to come to them.
 */
final class HeldStores {
    private static final Set<String> ALL = ConcurrentHashMap.newKeySet();
    private static final Set<String> UNREPORTED = ConcurrentHashMap.newKeySet();

    private HeldStores() {
    }

    /** Notes the store of a checkpoint file {@code <store>/SSTs/<name>} or {@code <store>/logs/<name>}. */
    static void noteCheckpointFile(Path file) {
        if (file == null || file.getParent() == null || file.getParent().getParent() == null) {
            return;
        }
        String dir = String.valueOf(file.getParent().getFileName());
        if (!dir.equals("SSTs") && !dir.equals("logs")) {
            return;
        }
        String store = file.getParent().getParent().toString();
        if (ALL.add(store)) {
            UNREPORTED.add(store);
        }
    }

    /** Stores taken but not reported after all: they go with the next report. */
    static void putBack(List<String> stores) {
        UNREPORTED.addAll(stores);
    }

    /** The stores noted since the last call. */
    static List<String> takeUnreported() {
        List<String> out = new ArrayList<>();
        for (String store : UNREPORTED) {
            if (UNREPORTED.remove(store)) {
                out.add(store);
            }
        }
        return out;
    }
}
