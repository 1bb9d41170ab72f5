"""Simulation at cluster scale: trace replay in virtual time over simulated replicas (`pdserve
simulate`), its report, the capacity planner on top (`pdserve plan`), and the calibration of a
profile from the real engine on this machine (`pdserve profile`)."""
