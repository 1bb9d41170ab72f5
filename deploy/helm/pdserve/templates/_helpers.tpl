{{/*
Names. The RayService name is capped at 40 characters: KubeRay appends "-raycluster-xxxxx" and
"-serve-svc" and requires the result to stay a valid DNS label.
*/}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels that select this release's Ray pods (KubeRay sets none of these keys). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: pdserve
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The pools that exist, comma-separated: the prefill pool only when disaggregated (with `models`,
when any model is). Each is a worker group, shared by every model's pool of that name. */}}
{{- define "pdserve.poolNames" -}}
{{- $pd := eq .Values.mode "disaggregated" -}}
{{- if .Values.models -}}
{{- $pd = false -}}
{{- range .Values.models -}}
{{- if eq (.mode | default "colocated") "disaggregated" -}}{{- $pd = true -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- if $pd -}}prefill,decode{{- else -}}decode{{- end -}}
{{- end -}}

{{/* A pool's spec as the chart renders it: its values less `worker`, pinned to its worker group. */}}
{{- define "pdserve.poolSpec" -}}
{{- $p := omit (.pool | default dict) "worker" -}}
{{- $res := merge (dict (include "pdserve.poolResource" .name) 1) (($p.resources | default dict) | deepCopy) -}}
{{- $_ := set $p "resources" $res -}}
{{- toYaml $p -}}
{{- end -}}

{{/* The custom Ray resource that pins a pool to its worker group. */}}
{{- define "pdserve.poolResource" -}}
{{- printf "pdserve_%s" . -}}
{{- end -}}

{{- define "pdserve.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else -}}
{{- printf "%s-api-key" (include "pdserve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
Checks that fail the render with a message naming the value, before anything reaches the cluster.
The spec itself is validated again by ClusterConfig when Serve builds the application.
*/}}
{{- define "pdserve.validate" -}}
{{- $v := .Values -}}
{{- if not (has $v.mode (list "colocated" "disaggregated")) -}}
{{- fail (printf "mode must be colocated or disaggregated, not %q" (toString $v.mode)) -}}
{{- end -}}
{{- if not (has $v.model.source (list "embedded" "pvc" "hostPath")) -}}
{{- fail (printf "model.source must be embedded, pvc or hostPath, not %q" (toString $v.model.source)) -}}
{{- end -}}
{{- if and (eq $v.model.source "pvc") (not $v.model.pvc.claimName) -}}
{{- fail "model.source is pvc: set model.pvc.claimName" -}}
{{- end -}}
{{- if and (eq $v.model.source "hostPath") (not $v.model.hostPath.path) -}}
{{- fail "model.source is hostPath: set model.hostPath.path" -}}
{{- end -}}
{{- if and (ne $v.model.source "embedded") (not (hasPrefix "/" $v.model.mountPath)) -}}
{{- fail "model.mountPath must be an absolute path" -}}
{{- end -}}
{{- range $m := ($v.models | default list) -}}
{{- if not $m.name -}}
{{- fail "models[]: every model needs a name (the id clients send)" -}}
{{- end -}}
{{- if and $m.path (eq $v.model.source "embedded") -}}
{{- fail (printf "models[%s].path is read from the model volume: set model.source to pvc or hostPath" $m.name) -}}
{{- end -}}
{{- range $name, $_ := ($m.pools | default dict) -}}
{{- if not (has $name (list "prefill" "decode")) -}}
{{- fail (printf "models[%s].pools.%s: pools are prefill and decode" $m.name $name) -}}
{{- end -}}
{{- if hasKey (index $m.pools $name | default dict) "worker" -}}
{{- fail (printf "models[%s].pools.%s.worker: worker groups are shared by the models; set pools.%s.worker" $m.name $name $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if hasKey $v.serving "api_key" -}}
{{- fail "serving.api_key would put the key in the RayService in clear text: use apiKey.existingSecret or apiKey.create" -}}
{{- end -}}
{{- range $name, $t := ($v.serving.tenants | default dict) -}}
{{- if hasKey $t "api_keys" -}}
{{- fail (printf "serving.tenants.%s.api_keys would put the keys in the RayService in clear text: use its api_key_env with `env` (a secretKeyRef), or serving.tenants_file on a mounted Secret" $name) -}}
{{- end -}}
{{- end -}}
{{- range $k := list "host" "port" "api_key_env" -}}
{{- if hasKey $v.serving $k -}}
{{- fail (printf "serving.%s is set by the chart; remove it from the values" $k) -}}
{{- end -}}
{{- end -}}
{{- if and $v.apiKey.enabled (not $v.apiKey.existingSecret) (not $v.apiKey.create) -}}
{{- fail "apiKey.enabled needs apiKey.existingSecret (a Secret you manage) or apiKey.create: true" -}}
{{- end -}}
{{- if not (has $v.disaggregation.connector (list "nixl" "torch_dist")) -}}
{{- fail (printf "disaggregation.connector must be nixl or torch_dist, not %q" (toString $v.disaggregation.connector)) -}}
{{- end -}}
{{- range $name := splitList "," (include "pdserve.poolNames" $) -}}
{{- $p := index $v.pools $name | default dict -}}
{{- if not $p.worker -}}
{{- fail (printf "pools.%s.worker (its Ray worker group) is missing" $name) -}}
{{- end -}}
{{- $w := $p.worker -}}
{{- $tp := $p.tensor_parallel_size | default 1 | int -}}
{{- $pp := $p.pipeline_parallel_size | default 1 | int -}}
{{- if hasKey ($w.rayStartParams | default dict) "resources" -}}
{{- fail (printf "pools.%s.worker.rayStartParams.resources is set by the chart (the pool's pdserve_%s resource)" $name $name) -}}
{{- end -}}
{{- if lt (int $w.pods) 1 -}}
{{- fail (printf "pools.%s.worker.pods must be at least 1" $name) -}}
{{- end -}}
{{- $minPods := $w.minPods | default $w.pods | int -}}
{{- $maxPods := $w.maxPods | default $w.pods | int -}}
{{- if or (hasKey $w "minPods") (hasKey $w "maxPods") -}}
{{- if not $v.autoscaler.enabled -}}
{{- fail (printf "pools.%s.worker.minPods/maxPods need autoscaler.enabled (without it the group keeps `pods`)" $name) -}}
{{- end -}}
{{- if not (and (le $minPods (int $w.pods)) (le (int $w.pods) $maxPods)) -}}
{{- fail (printf "pools.%s.worker: pods (%d) must lie within minPods (%d) and maxPods (%d)" $name (int $w.pods) $minPods $maxPods) -}}
{{- end -}}
{{- end -}}
{{- $replicas := $p.replicas | default 1 | int -}}
{{- with $p.autoscaling -}}
{{- $replicas = max $replicas (.max_replicas | default 1 | int) -}}
{{- end -}}
{{- $rankGpus := $p.num_gpus | default 0 | float64 -}}
{{- $podGpus := $w.gpus | default 0 | float64 -}}
{{- if gt $rankGpus 0.0 -}}
{{- $stageGpus := mulf $rankGpus $tp -}}
{{- if lt $podGpus $stageGpus -}}
{{- fail (printf "pools.%s: a pipeline stage takes %v GPUs (tensor_parallel_size x num_gpus) but worker.gpus is %v: the TP ranks of a stage must share a pod" $name $stageGpus $podGpus) -}}
{{- end -}}
{{- $needed := mulf $stageGpus $pp $replicas -}}
{{- $have := mulf $podGpus $maxPods -}}
{{- if lt $have $needed -}}
{{- fail (printf "pools.%s needs %v GPUs (replicas, or autoscaling.max_replicas, x TP x PP x num_gpus) but its worker group has %v (maxPods x gpus)" $name $needed $have) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The pdserve cluster spec (cluster/config.py ClusterConfig) as YAML. */}}
{{- define "pdserve.spec" -}}
{{- $v := .Values -}}
{{- $pools := dict -}}
{{- range $name := splitList "," (include "pdserve.poolNames" $) -}}
{{- $_ := set $pools $name (include "pdserve.poolSpec" (dict "name" $name "pool" (index $v.pools $name)) | fromYaml) -}}
{{- end -}}
{{- $serving := merge (dict "host" "0.0.0.0" "port" 8000) (deepCopy ($v.serving | default dict)) -}}
{{- if $v.apiKey.enabled -}}
{{- $_ := set $serving "api_key_env" "PDSERVE_API_KEY" -}}
{{- end -}}
{{- if $v.tenants.existingSecret -}}
{{- $_ := set $serving "tenants_file" (printf "/etc/pdserve/tenants/%s" $v.tenants.secretKey) -}}
{{- end -}}
{{- $model := "" -}}
{{- if eq $v.model.source "embedded" -}}
{{- $model = "" -}}
{{- else if $v.model.path -}}
{{- $model = printf "%s/%s" (trimSuffix "/" $v.model.mountPath) (trimPrefix "/" $v.model.path) -}}
{{- else -}}
{{- $model = $v.model.mountPath -}}
{{- end -}}
{{- $spec := dict
      "routing" (deepCopy ($v.routing | default dict))
      "serving" $serving
      "name" $v.name
      "placement_timeout_s" $v.placementTimeoutS
      "drain_timeout_s" $v.drainTimeoutS -}}
{{- if $v.models -}}
{{- /* Several models: each its own pools (on the shared worker groups) and its own model path
       under the model volume (`path` null: the embedded model). */ -}}
{{- $models := list -}}
{{- range $m := $v.models -}}
{{- $mode := $m.mode | default "colocated" -}}
{{- $mpools := dict -}}
{{- range $name, $p := ($m.pools | default (dict "decode" dict)) -}}
{{- $_ := set $mpools $name (include "pdserve.poolSpec" (dict "name" $name "pool" $p) | fromYaml) -}}
{{- end -}}
{{- $path := "" -}}
{{- if $m.path -}}
{{- $path = printf "%s/%s" (trimSuffix "/" $v.model.mountPath) (trimPrefix "/" $m.path) -}}
{{- end -}}
{{- $entry := dict "name" $m.name "aliases" ($m.aliases | default list) "model" (ternary nil $path (eq $path ""))
      "engine" (deepCopy ($m.engine | default dict)) "mode" $mode "pools" $mpools
      "disaggregation" (deepCopy ($m.disaggregation | default $v.disaggregation)) -}}
{{- with $m.lora -}}{{- $_ := set $entry "lora" (deepCopy .) -}}{{- end -}}
{{- with $m.serving -}}{{- $_ := set $entry "serving" (deepCopy .) -}}{{- end -}}
{{- $models = append $models $entry -}}
{{- end -}}
{{- $_ := set $spec "models" $models -}}
{{- else -}}
{{- $_ := set $spec "model" (ternary nil $model (eq $model "")) -}}
{{- $_ := set $spec "engine" (deepCopy ($v.engine | default dict)) -}}
{{- $_ := set $spec "mode" $v.mode -}}
{{- $_ := set $spec "pools" $pools -}}
{{- $_ := set $spec "disaggregation" (deepCopy $v.disaggregation) -}}
{{- end -}}
{{- toYaml $spec -}}
{{- end -}}

{{/* Env vars of every Ray container. */}}
{{- define "pdserve.env" -}}
{{- $v := .Values -}}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
- name: TOKENIZERS_PARALLELISM
  value: "false"
{{- /* Serve reads its proxies' channel from Ray's processes (records/serving.py: ServingSpec.ray_env) */}}
- name: RAY_SERVE_PROXY_USE_GRPC
  value: {{ ternary "0" "1" (eq ((($v.serving | default dict).proxy_channel) | default "grpc") "ray") | quote }}
{{- if $v.apiKey.enabled }}
- name: PDSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.apiKeySecretName" . }}
      key: {{ $v.apiKey.secretKey }}
{{- end }}
{{- if eq $v.disaggregation.connector "nixl" }}
{{- with $v.ucx.tls }}
- name: UCX_TLS
  value: {{ . | quote }}
{{- end }}
{{- with $v.ucx.netDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- range $k, $val := $v.ucx.extraEnv }}
- name: {{ $k }}
  value: {{ $val | toString | quote }}
{{- end }}
{{- else }}
{{- with $v.nccl.socketIfname }}
- name: NCCL_SOCKET_IFNAME
  value: {{ . | quote }}
{{- end }}
{{- with $v.nccl.ibHca }}
- name: NCCL_IB_HCA
  value: {{ . | quote }}
{{- end }}
{{- range $k, $val := $v.nccl.extraEnv }}
- name: {{ $k }}
  value: {{ $val | toString | quote }}
{{- end }}
{{- end }}
{{- with $v.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* rayStartParams as YAML: every value a string, as the CRD requires. Argument: a dict. */}}
{{- define "pdserve.rayStartParams" -}}
{{- $out := dict -}}
{{- range $k, $val := . -}}
{{- $_ := set $out $k (toString $val) -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
A Ray pod template. Arguments (dict): root, component (head | prefill | decode), container
(ray-head | ray-worker), group (head or pools.<name>.worker values), ports (list of dicts).
*/}}
{{- define "pdserve.podTemplate" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $g := .group -}}
metadata:
  labels:
    {{- include "pdserve.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $v.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $v.serviceAccountName }}
  serviceAccountName: {{ . }}
  {{- end }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: "{{ $v.image.repository }}:{{ $v.image.tag }}"
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- with $g.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      env:
        {{- include "pdserve.env" $root | nindent 8 }}
      ports:
        {{- toYaml .ports | nindent 8 }}
      resources:
        requests:
          cpu: {{ $g.cpu | quote }}
          memory: {{ $g.memory | quote }}
          {{- if gt ($g.gpus | default 0 | float64) 0.0 }}
          nvidia.com/gpu: {{ $g.gpus | toString | quote }}
          {{- end }}
        limits:
          cpu: {{ $g.cpu | quote }}
          memory: {{ $g.memory | quote }}
          {{- if gt ($g.gpus | default 0 | float64) 0.0 }}
          nvidia.com/gpu: {{ $g.gpus | toString | quote }}
          {{- end }}
          {{- range $k, $val := $g.extraResources }}
          {{ $k }}: {{ $val | toString | quote }}
          {{- end }}
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        {{- if ne $v.model.source "embedded" }}
        - name: model
          mountPath: {{ $v.model.mountPath }}
          readOnly: true
        {{- end }}
        {{- if $v.tenants.existingSecret }}
        - name: tenants
          mountPath: /etc/pdserve/tenants
          readOnly: true
        {{- end }}
  volumes:
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $g.shmSize | quote }}
    {{- if eq $v.model.source "pvc" }}
    - name: model
      persistentVolumeClaim:
        claimName: {{ $v.model.pvc.claimName }}
        readOnly: true
    {{- else if eq $v.model.source "hostPath" }}
    - name: model
      hostPath:
        path: {{ $v.model.hostPath.path }}
        type: {{ $v.model.hostPath.type | default "Directory" }}
    {{- end }}
    {{- if $v.tenants.existingSecret }}
    - name: tenants
      secret:
        secretName: {{ $v.tenants.existingSecret }}
        items:
          - key: {{ $v.tenants.secretKey }}
            path: {{ $v.tenants.secretKey }}
    {{- end }}
{{- end -}}
