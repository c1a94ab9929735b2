/** The device choice on the Configs page, and the strategy string it sends to /switch-model. */

export type Device = "cpu" | "cuda" | "albatross";

export const DEVICES: readonly Device[] = ["cpu", "cuda", "albatross"];

export const WORKERS_RANGE = { min: 1, max: 8, default: 1 } as const;
export const BATCH_RANGE = { min: 1, max: 4096, default: 32 } as const;

export interface StrategyInput {
  device: Device;
  workers: number;
  batch: number;
}

export type StrategyField = "workers" | "batch";

export type StrategyResult =
  | { ok: true; strategy: string }
  | { ok: false; field: StrategyField; range: { min: number; max: number } };

/** Classic devices map to the official backend's strategies; "CUDA High Performance" to Albatross. */
export function buildStrategy(input: StrategyInput): StrategyResult {
  switch (input.device) {
    case "cpu":
      return { ok: true, strategy: "cpu fp32" };
    case "cuda":
      return { ok: true, strategy: "cuda fp16" };
    case "albatross": {
      // The server ignores an invalid value and keeps its default; the GUI never sends one.
      if (!inRange(input.workers, WORKERS_RANGE)) return { ok: false, field: "workers", range: WORKERS_RANGE };
      if (!inRange(input.batch, BATCH_RANGE)) return { ok: false, field: "batch", range: BATCH_RANGE };
      return { ok: true, strategy: `albatross workers=${input.workers} batch=${input.batch}` };
    }
  }
}

/**
 * The device to preselect until the person picks one: "CUDA High Performance" needs an NVIDIA
 * GPU, so on a server that reports none (`gpu_available: false` in /status) the CPU is
 * preselected; the CUDA devices stay on offer. Unknown (no status yet): Albatross.
 */
export function suggestedDevice(gpuAvailable: boolean | undefined): Device {
  return gpuAvailable === false ? "cpu" : "albatross";
}

/** Whether the device's strategy can be tuned with workers and batch. */
export function usesWorkersAndBatch(device: Device): boolean {
  return device === "albatross";
}

/** Reads an integer typed by a person; anything else (empty, "3.5", "1e3", "abc") is NaN. */
export function parseWholeNumber(text: string): number {
  const trimmed = text.trim();
  return /^\d+$/.test(trimmed) ? Number(trimmed) : Number.NaN;
}

function inRange(value: number, range: { min: number; max: number }): boolean {
  return Number.isInteger(value) && value >= range.min && value <= range.max;
}
