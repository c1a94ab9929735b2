/** The runner control routes the GUI uses (docs/api.md, "Runner control"). */

import type { ApiClient } from "./client";

export enum ModelStatus {
  Offline = 0,
  Loading = 2,
  Working = 3,
}

export interface ServerStatus {
  status: ModelStatus;
  pid?: number;
  device_name?: string;
  gpu_available?: boolean;
  backend?: string | null;
  strategy?: string | null;
  model?: string | null;
  model_path?: string | null;
  effective?: Record<string, unknown> | null;
  [extra: string]: unknown;
}

export interface LocalModel {
  name: string;
  path: string;
  size_bytes: number;
}

export interface SwitchModelBody {
  model: string;
  strategy: string;
}

export interface SamplingDefaults {
  max_tokens: number;
  temperature: number;
  top_p: number;
  top_k: number;
  presence_penalty: number;
  frequency_penalty: number;
  penalty_decay: number;
}

export const getStatus = (client: ApiClient, signal?: AbortSignal): Promise<ServerStatus> =>
  client.getJson<ServerStatus>("/status", signal);

export async function getLocalModels(client: ApiClient): Promise<LocalModel[]> {
  const body = await client.getJson<{ models?: LocalModel[] }>("/local-models");
  return body.models ?? [];
}

export async function getLoadedModelIds(client: ApiClient): Promise<string[]> {
  const body = await client.getJson<{ data?: { id: string }[] }>("/v1/models");
  return (body.data ?? []).map((entry) => entry.id);
}

export const switchModel = (client: ApiClient, body: SwitchModelBody): Promise<unknown> =>
  client.postJson<unknown>("/switch-model", body);

export const updateConfig = (client: ApiClient, defaults: SamplingDefaults): Promise<unknown> =>
  client.postJson<unknown>("/update-config", defaults);
