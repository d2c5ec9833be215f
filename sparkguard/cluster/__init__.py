"""The operator's view of a TP cluster: one cluster file for every node, ``sparkguard cluster``
(status and incidents read from every node, lane/stop/start/restart over SSH).

Not to be confused with :mod:`sparkguard.supervisor.cluster`, the pure core with which each
node's own supervisor recovers its rank with the others'.
"""
