"""ZooKeeper's side of `lockmesh-load --recipes` (docs/BENCHMARKS.md, recipes).

Runs one recipe of kazoo (the Python client of ZooKeeper, whose recipes follow
Curator's) with N clients, each on its own ZooKeeper session and thread, for a
warm-up and a measured window, and prints one JSON line: cycles completed in the
window, acquire latencies (p50, p99, ms) and errors. Started by lockmesh-load
with the interpreter of `.tools/bench` (`scripts/setup --bench`); not part of the
test command.

Recipes (the same shapes as lockmesh's side):
  mutex     Lock(path) by every client: one hot key
  mutex-own Lock(path_i), a path per client: uncontended
  election  Election(path).run(lambda: None): campaign, lead, give up at once
  rw        client i % 4 == 0 takes WriteLock(path), the others ReadLock(path)
  multikey  client i takes Lock(k_i) then Lock(k_{i+1}) of a ring of N keys, in
            key order (the usual deadlock-free multi-lock)
  permits   Semaphore(path, max_leases=2): at most two holders at once, as two
            lockmesh holders of 2 of 4 permits
"""

import argparse
import json
import sys
import threading
import time

from kazoo.client import KazooClient


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hosts", required=True)
    p.add_argument("--recipe", required=True, choices=["mutex", "mutex-own", "election", "rw", "multikey", "permits"])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=1.0)
    a = p.parse_args()

    clients = []
    for _ in range(a.clients):
        zk = KazooClient(hosts=a.hosts, timeout=15.0)
        zk.start(timeout=15)
        clients.append(zk)
    base = "/bench/%s-%d" % (a.recipe, int(time.time() * 1000))
    start = time.monotonic() + a.warmup
    end = start + a.seconds
    lat, cycles, errors = [], [0], [0]
    lock = threading.Lock()

    def make(i, zk):
        ident = "c%d" % i
        if a.recipe in ("mutex", "mutex-own"):
            l = zk.Lock(base + ("/m" if a.recipe == "mutex" else "/m%d" % i), ident)
            return lambda: (l.acquire(), l.release())
        if a.recipe == "election":
            e = zk.Election(base + "/e", ident)
            return lambda: e.run(lambda: None)
        if a.recipe == "rw":
            l = zk.WriteLock(base + "/rw", ident) if i % 4 == 0 else zk.ReadLock(base + "/rw", ident)
            return lambda: (l.acquire(), l.release())
        if a.recipe == "multikey":
            ks = sorted(["%s/k%d" % (base, i % a.clients), "%s/k%d" % (base, (i + 1) % a.clients)])
            ls = [zk.Lock(k, ident) for k in ks]

            def both():
                for l in ls:
                    l.acquire()
                for l in reversed(ls):
                    l.release()

            return both
        s = zk.Semaphore(base + "/sem", ident, max_leases=2)
        return lambda: (s.acquire(), s.release())

    def loop(i, zk):
        cycle = make(i, zk)
        while True:
            t0 = time.monotonic()
            if t0 >= end:
                return
            try:
                cycle()
            except Exception:  # counted, never fatal: the window goes on
                with lock:
                    errors[0] += 1
                time.sleep(0.05)
                continue
            t1 = time.monotonic()
            if start <= t1 <= end:
                with lock:
                    cycles[0] += 1
                    lat.append((t1 - t0) * 1000.0)

    threads = [threading.Thread(target=loop, args=(i, zk), daemon=True) for i, zk in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=a.seconds + a.warmup + 60)
    for zk in clients:
        try:
            zk.stop()
            zk.close()
        except Exception:
            pass
    lat.sort()

    def pct(q):
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0

    json.dump(
        {"cycles": cycles[0], "per_s": cycles[0] / a.seconds, "p50_ms": pct(0.5), "p99_ms": pct(0.99), "errors": errors[0]},
        sys.stdout,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
