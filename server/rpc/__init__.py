"""gRPC edge: the auth + error interceptor, proto↔domain conversion and thin servicers."""
