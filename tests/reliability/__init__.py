"""Fault, bad-input, security and load tests with real processes, real gRPC and real Redis."""
