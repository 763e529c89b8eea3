"""`edl-agent hosts`: the workers of a job fit to train on, as an elastic launcher's host
discovery wants them (Horovod's `--host-discovery-script`). `decide` is pure (pods, nodes and
claims as the API returns them → `host:slots` lines), `read` the API reads at the edge, and
`command` the subcommand."""
