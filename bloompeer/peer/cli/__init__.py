"""The `bloompeer` command: its subcommands (dht, serve, generate, status, api), their flags and
the configs built from them, and the local swarms a command starts for itself.

This is the top room of the package: it uses `client`, `server` and `api`, and nothing below
imports it. The entry point is `main.main`.
"""
