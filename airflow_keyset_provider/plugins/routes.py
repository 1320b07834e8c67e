"""Where the Keyset page lives: the API server mount, the UI routes and the bundle's file name.
``keyset.py`` (the plugin) and ``app.py`` (the FastAPI app it mounts) both read them from here."""

URL_PREFIX = "/keyset"
UI_ROUTE = "keyset"
RUN_UI_ROUTE = "keyset-run"
TASK_UI_ROUTE = "keyset-range"
BUNDLE_FILE = "keyset-ui.js"
#: The names the bundle registers itself under (``ui/src/main.jsx`` APP_NAMES): Airflow renders
#: ``globalThis[<app name>]``.
REACT_APP_NAMES = ("Keyset traversals", "Keyset round", "Keyset range")
