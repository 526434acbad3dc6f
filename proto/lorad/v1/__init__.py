"""Generated lorad.v1 gRPC API code (do not edit; `make proto`)."""
