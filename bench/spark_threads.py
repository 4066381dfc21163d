"""CPU of every thread of a Spark job's JVM, grouped by thread name (issue 32, docs/benchmarks.md
"Spark audit at 10M records, fourth round"): runs the command, samples
``/proc/<java>/task/*/stat`` of its ``java`` descendant every 0.5 s, prints CPU seconds per
thread kind (JIT compiler threads, executor task threads, the py4j ``Thread-N`` that plans
queries, GC, ...) when it exits. A thread that exits between samples loses its last 0.5 s.

    PYTHONPATH=. python bench/spark_threads.py python bench/bench_spark.py --records 3000000 --phases audit
"""
import os, re, subprocess, sys, time, collections, psutil
p = subprocess.Popen(sys.argv[1:])
tick = os.sysconf("SC_CLK_TCK")
last = {}
def jvm():
    try:
        for c in psutil.Process(p.pid).children(recursive=True):
            if c.name() == "java": return c.pid
    except psutil.Error: pass
while p.poll() is None:
    j = jvm()
    if j:
        try:
            for t in os.listdir(f"/proc/{j}/task"):
                try:
                    comm = open(f"/proc/{j}/task/{t}/comm").read().strip()
                    st = open(f"/proc/{j}/task/{t}/stat").read().rsplit(")", 1)[1].split()
                    last[t] = (comm, (int(st[11]) + int(st[12])) / tick)
                except OSError: pass
        except OSError: pass
    time.sleep(0.5)
agg = collections.Counter()
for comm, cpu in last.values():
    k = re.sub(r"[0-9]+", "#", comm)
    agg[k] += cpu
for k, v in agg.most_common(25): print(f"{v:8.1f} {k}")
print(f"{sum(agg.values()):8.1f} total")
