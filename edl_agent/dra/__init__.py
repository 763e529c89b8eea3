"""Dynamic Resource Allocation: ResourceSlices, the DRA kubelet plugin and CDI specs."""
