"""The daemon: wiring of all layers, the mount's lifecycle, signals and the control socket."""
