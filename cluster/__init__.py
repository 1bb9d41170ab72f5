"""Ray actors, pools, placement and the `pdserve` command line."""
