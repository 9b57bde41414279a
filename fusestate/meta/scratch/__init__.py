"""A shared volume's scratch directories: their contents kept in this node's memory
(``namespace``), over the shared engine that holds the rest of the volume."""
