"""The FUSE adapter: kernel requests translated to vfs calls, nothing more."""
