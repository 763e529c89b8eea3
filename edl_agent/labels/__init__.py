"""Node labels from the inventory (pure), the AcceleratorHealthy condition and Events, and the
updater that writes them to this node's Node object."""
