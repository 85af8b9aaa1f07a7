"""The benchmarks of `moeflash bench` (one subcommand each) and their building blocks (memory cgroups,
disk ceiling)."""
