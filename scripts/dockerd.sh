#!/usr/bin/env bash
# Start (or stop) a Docker daemon for tests that build local images.
#   scripts/dockerd.sh start  -> exit 0 when `docker info` answers (starts dockerd if needed,
#                               installing docker.io with apt-get when root and absent);
#                               exit 1 with the reason on stderr otherwise.
#   scripts/dockerd.sh stop   -> stops the daemon this script started (by its PID file).
# No image is ever pulled: callers build images from local files and run them with host
# networking (dockerd runs with --bridge=none --iptables=false).
set -uo pipefail
PIDFILE=/tmp/hourglass-dockerd.pid
LOG=/tmp/hourglass-dockerd.log
cmd=${1:-start}
if [ "$cmd" = stop ]; then
  if [ -f "$PIDFILE" ]; then
    pid=$(cat "$PIDFILE"); kill "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    rm -f "$PIDFILE"
  fi
  exit 0
fi
if docker info >/dev/null 2>&1; then exit 0; fi
if ! command -v dockerd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null 2>&1 \
      || { echo "dockerd.sh: apt-get install docker.io failed" >&2; exit 1; }
  else
    echo "dockerd.sh: no dockerd and not root: cannot install docker.io" >&2; exit 1
  fi
fi
if [ "$(id -u)" != 0 ]; then echo "dockerd.sh: starting dockerd needs root" >&2; exit 1; fi
# a lock so that two callers do not start two daemons
exec 9>/tmp/hourglass-dockerd.lock
flock -w 120 9 || { echo "dockerd.sh: lock busy" >&2; exit 1; }
if docker info >/dev/null 2>&1; then exit 0; fi
setsid dockerd --bridge=none --iptables=false --ip6tables=false >"$LOG" 2>&1 < /dev/null &
echo $! > "$PIDFILE"
for _ in $(seq 1 150); do
  if docker info >/dev/null 2>&1; then exit 0; fi
  kill -0 "$(cat "$PIDFILE")" 2>/dev/null || break
  sleep 0.2
done
echo "dockerd.sh: dockerd did not start; last log lines:" >&2
tail -n 20 "$LOG" >&2
exit 1
