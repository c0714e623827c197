"""gRPC over HTTP/2 for the router's public port, served on the event loop (see server.py)."""
