"""The benchmark harness (`moeflash bench`) and its building blocks (memory cgroups, disk ceiling)."""
