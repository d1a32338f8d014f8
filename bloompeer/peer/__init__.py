"""Who does it: the server that serves blocks, the client that routes through them, and the CLI."""
