"""The composition root: the cluster spec, replica actors, pools, the manager, placement, the Serve
application of a spec (`app.py`), launch and the `pdserve` command line."""
