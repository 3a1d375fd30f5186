"""Operations: a run's and the fleet's state as operators watch it (status and its view, the status report with
the broker's view laid over it, metrics, fleet and queue views, what `regen run` watches while it runs). It
imports only the shared base in `app/`."""
