"""What the router and the workers share about a worker client, below both: the lifecycle state machine
(`lifecycle`) and the base of the clients whose worker lives in this process (`local`). The router runs
the clients; `hybridgate.workers.inprocess` is one; neither imports the other."""
