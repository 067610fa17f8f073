"""What the tests share: fault-injecting seams, rank launch, graph capture and toy specs."""
