"""``hp demo --elastic``: the elastic job and its runner."""
