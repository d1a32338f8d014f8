"""`bloompeer api`: an OpenAI-compatible HTTP API, a swarm dashboard and Prometheus metrics, all
served by one bloompeer client (see app.py). Nothing is imported here, so that building the CLI's
parser does not load the web stack."""
