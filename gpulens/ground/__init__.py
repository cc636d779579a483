"""The ground floor: what every component uses and nothing else provides, with no component above
it imported back: structured log lines (`logs`), a server's signal-driven lifetime (`lifecycle`),
argparse value types (`argtypes`) and help formatting (`helptext`). The standard library only."""
