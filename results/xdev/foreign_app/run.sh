#!/usr/bin/env bash
# A Flower app that is not fedcomp's own, integrated as the README tells users (compression_mod +
# CompressedStrategy). Usage: ./run.sh "upload='auto' download='auto' num-server-rounds=40"
# start a SuperLink (own FLWR_HOME, own port), run the foreign app with the given run config, stop it by PGID
set -u
export FLWR_HOME=/tmp/foreign_home FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
mkdir -p $FLWR_HOME
PORT=$(python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
printf '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:%s"\ninsecure = true\n' $PORT > $FLWR_HOME/config.toml
setsid flower-superlink --insecure --simulation --isolation subprocess --host 127.0.0.1 --port $PORT > $FLWR_HOME/superlink.log 2>&1 &
SL=$!
for i in $(seq 60); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 0.5; done
flwr federation simulation-config --num-supernodes 20 >/dev/null
flwr run "$(dirname "$0")" --stream --run-config "$1" > "${LOG:-/tmp/foreign_last.log}" 2>&1; grep -E "FOREIGN" "${LOG:-/tmp/foreign_last.log}"
kill -TERM -$SL; sleep 2; kill -KILL -$SL 2>/dev/null; wait $SL 2>/dev/null
