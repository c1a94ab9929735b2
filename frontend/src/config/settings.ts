/** Everything the person sets, kept in the browser (localStorage) between visits. */

import type { Sampling } from "../api/streams";
import type { KeyValueStore } from "../api/client";
import { BATCH_RANGE, DEVICES, suggestedDevice, WORKERS_RANGE, type Device } from "./strategy";
import { LANGUAGES, type Language } from "../i18n/strings";

export const SETTINGS_KEY = "rwkv-webui.settings.v1";

export interface Settings {
  language: Language;
  modelPath: string;
  device: Device;
  deviceChosen: boolean; // false: `device` follows the server (suggestedDevice) until the person picks one
  workers: number;
  batch: number;
  serverDefaults: Sampling;
  chatSampling: Sampling;
  completionSampling: Sampling;
  completionPrompt: string;
  batchCount: number;
}

/** A change to the settings: the fields to set, or a function of the settings as they are when
 * the change is applied (not as some earlier render saw them). */
export type SettingsUpdate = Partial<Settings> | ((current: Settings) => Partial<Settings>);

/** `current` with `change` applied; `current` itself when nothing changes (no render, no save). */
export function applySettingsUpdate(current: Settings, change: SettingsUpdate): Settings {
  const patch = typeof change === "function" ? change(current) : change;
  const changed = (Object.keys(patch) as (keyof Settings)[]).some((key) => patch[key] !== current[key]);
  return changed ? { ...current, ...patch } : current;
}

/**
 * The change that makes the device follow the server (suggestedDevice) until the person picks one.
 * Given to `update` as a function, so it reads `deviceChosen` when it is applied: a pick made
 * between the status's arrival and this change (the browser test saw one) is never undone.
 */
export function followServerDevice(gpuAvailable: boolean): (current: Settings) => Partial<Settings> {
  return (current) => (current.deviceChosen ? {} : { device: suggestedDevice(gpuAvailable) });
}

/** The runner's own defaults (docs/api.md), so an untouched form changes nothing. */
export const RUNNER_SAMPLING: Sampling = {
  max_tokens: 500,
  temperature: 1.0,
  top_p: 0.3,
  top_k: 0,
  presence_penalty: 0,
  frequency_penalty: 1,
  penalty_decay: 0.996,
};

export function defaultSettings(browserLanguage: string): Settings {
  return {
    language: languageFor(browserLanguage),
    modelPath: "",
    device: suggestedDevice(undefined),
    deviceChosen: false,
    workers: WORKERS_RANGE.default,
    batch: BATCH_RANGE.default,
    serverDefaults: { ...RUNNER_SAMPLING },
    chatSampling: { ...RUNNER_SAMPLING },
    completionSampling: { ...RUNNER_SAMPLING, max_tokens: 100 },
    completionPrompt: "User: Write a short poem about the sea.\n\nAssistant:",
    batchCount: 8,
  };
}

export function languageFor(browserLanguage: string): Language {
  const lower = browserLanguage.toLowerCase();
  if (lower.startsWith("zh")) return "zh";
  if (lower.startsWith("ja")) return "ja";
  return "en";
}

/** Stored values that are missing or of the wrong type fall back to the defaults, one by one. */
export function loadSettings(store: KeyValueStore, browserLanguage: string): Settings {
  const defaults = defaultSettings(browserLanguage);
  let stored: Record<string, unknown>;
  try {
    const parsed: unknown = JSON.parse(store.getItem(SETTINGS_KEY) ?? "{}");
    stored = typeof parsed === "object" && parsed !== null ? (parsed as Record<string, unknown>) : {};
  } catch {
    return defaults;
  }
  return {
    language: oneOf(stored.language, LANGUAGES, defaults.language),
    modelPath: typeof stored.modelPath === "string" ? stored.modelPath : defaults.modelPath,
    device: oneOf(stored.device, DEVICES, defaults.device),
    deviceChosen: typeof stored.deviceChosen === "boolean" ? stored.deviceChosen : defaults.deviceChosen,
    workers: integerIn(stored.workers, WORKERS_RANGE, defaults.workers),
    batch: integerIn(stored.batch, BATCH_RANGE, defaults.batch),
    serverDefaults: samplingFrom(stored.serverDefaults, defaults.serverDefaults),
    chatSampling: samplingFrom(stored.chatSampling, defaults.chatSampling),
    completionSampling: samplingFrom(stored.completionSampling, defaults.completionSampling),
    completionPrompt: typeof stored.completionPrompt === "string" ? stored.completionPrompt : defaults.completionPrompt,
    batchCount: integerIn(stored.batchCount, { min: 1, max: 1000 }, defaults.batchCount),
  };
}

export function saveSettings(store: KeyValueStore, settings: Settings): void {
  store.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

function samplingFrom(value: unknown, fallback: Sampling): Sampling {
  if (typeof value !== "object" || value === null) return { ...fallback };
  const record = value as Record<string, unknown>;
  const result = { ...fallback };
  for (const key of Object.keys(fallback) as (keyof Sampling)[]) {
    const field = record[key];
    if (typeof field === "number" && Number.isFinite(field)) result[key] = field;
  }
  return result;
}

function oneOf<T extends string>(value: unknown, allowed: readonly T[], fallback: T): T {
  return allowed.includes(value as T) ? (value as T) : fallback;
}

function integerIn(value: unknown, range: { min: number; max: number }, fallback: number): number {
  return typeof value === "number" && Number.isInteger(value) && value >= range.min && value <= range.max ? value : fallback;
}
