"""Blocks: content-addressed objects, their caches, staging and upload workers."""
