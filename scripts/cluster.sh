#!/usr/bin/env bash
# The project's single-node Kubernetes test cluster: up | down | status | env | load IMAGE.tar.
# See cluster/cluster.sh (what it runs, where its state lives) and README.md "Deployment".
exec bash "$(dirname "$0")/../cluster/cluster.sh" "$@"
