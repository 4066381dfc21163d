"""Task CPU per stage from a Spark event log (issue 32): run the job with
``--conf spark.eventLog.enabled=true --conf spark.eventLog.dir=DIR --conf spark.eventLog.compress=false``
and give this the events file. Columns: tasks, run and CPU seconds of the task threads (the
Python side of a data source scan is not in them), GC, shuffle written/read, records.

    python bench/spark_stages.py DIR/eventlog_v2_local-*/events_1_*
"""
import json
import sys

path = sys.argv[1]
stages = []
for line in open(path):
    e = json.loads(line)
    ev = e["Event"]
    if ev == "SparkListenerStageCompleted":
        si = e["Stage Info"]
        acc = {a["Name"]: a.get("Value") for a in si.get("Accumulables", [])}
        def g(k):
            v = acc.get(k, 0)
            try: return float(v)
            except: return 0
        stages.append((si["Stage ID"], si["Number of Tasks"], si["Stage Name"][:60],
                       g("internal.metrics.executorRunTime")/1e3, g("internal.metrics.executorCpuTime")/1e9,
                       g("internal.metrics.jvmGCTime")/1e3,
                       g("internal.metrics.shuffle.write.bytesWritten")/1e6, g("internal.metrics.shuffle.read.localBytesRead")/1e6,
                       g("internal.metrics.input.recordsRead"), g("internal.metrics.shuffle.write.recordsWritten"),
                       (si.get("Completion Time",0)-si.get("Submission Time",0))/1e3))
tot_cpu = tot_run = 0
print("stage tasks name | run_s cpu_s gc_s shw_MB shr_MB in_rec shw_rec wall_s")
for s in stages:
    print("%3d %3d %-60s | %6.1f %6.1f %5.1f %7.1f %7.1f %9d %9d %6.1f" % s)
    tot_run += s[3]; tot_cpu += s[4]
print("total run %.1f cpu %.1f" % (tot_run, tot_cpu))
