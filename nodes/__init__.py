"""One module per node kind. Each keeps its logic in a core class that owns no sockets and a short
``run(topo, replica, base)`` that wires it to the bus. Nodes never import one another."""
