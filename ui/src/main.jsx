// Entry of the bundle Airflow's UI loads for the plugin's react_apps (see vite.config.js).
//
// Airflow's loader evaluates the module at `bundle_url` once, then renders `globalThis[<app name>]`
// (else `globalThis.AirflowPlugin`, which it clears before each load). The three apps share one
// bundle URL, so the module registers itself under every app name the plugin declares
// (plugins/keyset.py REACT_APP_NAMES; tests/ui/test_ui_bundle.py checks the two lists agree).
import KeysetApp from "./KeysetApp.jsx";

const APP_NAMES = ["Keyset traversals", "Keyset round", "Keyset range"];
for (const name of APP_NAMES) globalThis[name] = KeysetApp;

export default KeysetApp;
