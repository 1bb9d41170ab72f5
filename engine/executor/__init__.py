"""Executors drive an engine's ranks: in-process (one rank) or Ray worker actors (TP x PP), and
the Ray helpers that place them (`ray_cluster`)."""
