#!/usr/bin/env bash
# Launches NPROC processes of a PyTorch script on this machine the ecosystem's way
# (torch.distributed.run), robustly on Debian 12's torch 1.13:
# - --redirects/--tee are given (1: stdout to a log and the console): the launcher's own default
#   of 0 fails on Python 3.11 (its IntFlag parsing returns None for 0);
# - the rendezvous is static on 127.0.0.1 at a free port (`--standalone` resolves "localhost",
#   which a minimal system without /etc/hosts cannot, and a fixed port collides with a second
#   launch).
# Usage: examples/launch.sh NPROC SCRIPT [ARGS...]   or   examples/launch.sh NPROC -m MODULE [ARGS...]
set -euo pipefail
nproc=$1
shift
# One machine: gloo talks over the loopback interface (no hostname lookup).
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
exec /usr/bin/python3 -m torch.distributed.run --nnodes 1 --nproc_per_node "$nproc" --master_addr 127.0.0.1 \
  --master_port "$port" --redirects 1 --tee 1 "$@"
