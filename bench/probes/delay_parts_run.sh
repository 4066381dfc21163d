#!/bin/bash
# The thread-CPU probe of docs/benchmarks.md ("fourteenth session"): in a scratch worktree
# with bench/probes/delay_parts.patch applied (git worktree add /tmp/probe HEAD; cd /tmp/probe;
# git apply bench/probes/delay_parts.patch), TREE=/tmp/probe bash bench/probes/delay_parts_run.sh N EXTRA_MS CALLS
# starts a dev cluster from it, runs bench_call, and prints the delay node's main-thread CPU per call by part.
TREE=${TREE:?the probed worktree}
n=$1; extra=$2; calls=$3
dir=/tmp/hg-probe; rm -rf $dir /tmp/probe.*.json
cd $TREE
env $ENVX PYTHONPATH=$TREE python3 -m cluster.cli dev up --data $dir > $dir.log 2>&1 &
up=$!
for i in $(seq 60); do grep -q "cluster up" $dir.log 2>/dev/null && break; sleep 0.5; done; sleep 2
M=$(python3 -c "import json;print(json.load(open('$dir/cluster.json'))['meta'][0])")
D=$(python3 -c "import json;print(json.load(open('$dir/cluster.json'))['pids']['delay-1'])")
kill -USR2 $D; sleep 0.5; cp /tmp/probe.$D.json /tmp/probe0.json
EXTRA_MS=$extra PYTHONPATH=$TREE python3 bench/bench_call.py $M $n $calls $D | tail -1
kill -USR2 $D; sleep 0.5; cp /tmp/probe.$D.json /tmp/probe1.json
kill -INT $up; wait $up 2>/dev/null
python3 - $calls <<'PY'
import json,sys
a=json.load(open('/tmp/probe0.json')); b=json.load(open('/tmp/probe1.json')); calls=int(sys.argv[1])+20
print(f"main thread cpu per call: {(b['thread_cpu']-a['thread_cpu'])/calls*1e6:.0f} us; process: {(b['proc_cpu']-a['proc_cpu'])/calls*1e6:.0f} us")
tot=0
for k,(c,t) in b['probe'].items():
    c0,t0=a['probe'].get(k,[0,0.0]); dt=(t-t0)/calls*1e6; tot+=dt
    print(f"  {k:12} {c-c0:6d} calls  {dt:7.0f} us per producer call")
print(f"  sum {tot:.0f} us")
PY
