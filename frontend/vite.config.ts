import { defineConfig } from "vitest/config";

// Plain esbuild JSX (React 17+ automatic runtime): no React plugin needed, so the build has
// no dependency that may fail to install on these machines.
export default defineConfig({
  base: "./",
  esbuild: { jsx: "automatic", jsxImportSource: "react" },
  build: {
    outDir: "dist",
    emptyOutDir: true,
    chunkSizeWarningLimit: 1500,
    rollupOptions: {
      // Fluent UI marks modules "use client" for React Server Components; meaningless in an SPA.
      onwarn(warning, warn) {
        if (warning.code !== "MODULE_LEVEL_DIRECTIVE") warn(warning);
      },
    },
  },
  server: {
    // `npm run dev` against a backend on :8000; the built app is served by the backend itself.
    proxy: Object.fromEntries(
      ["/status", "/switch-model", "/update-config", "/local-models", "/v1", "/healthz"].map((route) => [
        route,
        { target: process.env.BACKEND_URL ?? "http://127.0.0.1:8000", changeOrigin: true },
      ]),
    ),
  },
  test: { include: ["tests/unit/**/*.test.ts"], environment: "node" },
});
