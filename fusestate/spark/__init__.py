"""Spark Structured Streaming with its state on a fusestate mount: configuration and a reference pipeline."""
