"""Small runnable demos (``hybridflow-lab demo``)."""
