"""Operations: a run's and the fleet's state as operators watch it (status and its view, metrics, fleet and
queue views). It imports only the shared base in `app/`."""
