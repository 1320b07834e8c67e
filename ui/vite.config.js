// Builds the Keyset page as one JavaScript module for Airflow 3's plugin loader (`react_apps`).
//
// Airflow's UI imports the bundle (`import(bundle_url)`) and renders the function it finds at
// `globalThis[<app name>]`, else `globalThis.AirflowPlugin`, inside its own React tree. It puts its
// own React, ReactDOM, JSX runtime and Chakra UI on `globalThis` for plugins (`React`, `ReactDOM`,
// `ReactJSXRuntime`, `ChakraUI`), so the bundle leaves them out: the page uses the very Chakra
// instance and theme the Airflow UI renders with, light and dark mode included. UMD because a
// module's top-level `var` is not global: UMD assigns `globalThis.AirflowPlugin` itself.
import { resolve } from "node:path";
import { defineConfig } from "vite";

const OUT_DIR = resolve(import.meta.dirname, "../airflow_keyset_provider/plugins/static/ui");

export default defineConfig({
  build: {
    outDir: OUT_DIR,
    emptyOutDir: true,
    minify: true,
    sourcemap: false,
    lib: {
      entry: resolve(import.meta.dirname, "src/main.jsx"),
      formats: ["umd"],
      name: "AirflowPlugin",
      fileName: () => "keyset-ui.js",
    },
    rolldownOptions: {
      external: ["react", "react/jsx-runtime", "@chakra-ui/react"],
      output: {
        globals: {
          react: "React",
          "react/jsx-runtime": "ReactJSXRuntime",
          "@chakra-ui/react": "ChakraUI",
        },
      },
    },
  },
  define: { "process.env.NODE_ENV": JSON.stringify("production") },
});
