{{/* Names and labels. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's base name; the RayCluster is named this too (KubeRay's head Service is
     "<it>-head-svc"), so it stays short enough for KubeRay's derived names. */}}
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

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pdserve.routerSelectorLabels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/component: router
{{- end -}}

{{/* Every router pod, the pool owner's and the --router-only ones: what the Service, the
     PodDisruptionBudget and the router NetworkPolicy select. */}}
{{- define "pdserve.routerFrontLabel" -}}
pdserve.io/router: "true"
{{- end -}}

{{- define "pdserve.routerFrontLabels" -}}
{{ include "pdserve.selectorLabels" . }}
{{ include "pdserve.routerFrontLabel" . }}
{{- end -}}

{{/* Router pods in all: one pool owner and router.replicas - 1 --router-only routers. */}}
{{- define "pdserve.routerReplicas" -}}
{{- include "pdserve.positiveInt" (list "router.replicas" .Values.router.replicas) -}}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "pdserve.rayHead" -}}
{{- printf "%s-head-svc.%s.svc" (include "pdserve.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* A positive integer from values, or fail naming the key. */}}
{{- define "pdserve.positiveInt" -}}
{{- $v := index . 1 -}}
{{- $ok := or (kindIs "float64" $v) (kindIs "int" $v) (kindIs "int64" $v) -}}
{{- if $ok -}}{{- $ok = and (ge (int $v) 1) (eq (float64 (int $v)) (float64 $v)) -}}{{- end -}}
{{- if not $ok -}}
{{- fail (printf "%s must be an integer >= 1, got %v" (index . 0) $v) -}}
{{- end -}}
{{- int $v -}}
{{- end -}}

{{/* Pool sizes: everything below derives from .Values.prefill / .Values.decode. */}}
{{- define "pdserve.prefillPerPod" -}}
{{- include "pdserve.positiveInt" (list "prefill.workersPerPod" .Values.prefill.workersPerPod) -}}
{{- end -}}

{{- define "pdserve.prefillWorkers" -}}
{{- $r := include "pdserve.positiveInt" (list "prefill.replicas" .Values.prefill.replicas) | int -}}
{{- mul $r (include "pdserve.prefillPerPod" . | int) -}}
{{- end -}}

{{- define "pdserve.prefillGpusPerPod" -}}
{{- $g := .Values.prefill.gpusPerWorker | int -}}
{{- if lt $g 0 -}}{{- fail (printf "prefill.gpusPerWorker must be >= 0, got %v" .Values.prefill.gpusPerWorker) -}}{{- end -}}
{{- mul $g (include "pdserve.prefillPerPod" . | int) -}}
{{- end -}}

{{- define "pdserve.decodeTp" -}}
{{- include "pdserve.positiveInt" (list "decode.tp (tensor-parallel ranks per decode group)" .Values.decode.tp) -}}
{{- end -}}

{{- define "pdserve.decodePerPod" -}}
{{- include "pdserve.positiveInt" (list "decode.groupsPerPod" .Values.decode.groupsPerPod) -}}
{{- end -}}

{{- define "pdserve.decodeWorkers" -}}
{{- $r := include "pdserve.positiveInt" (list "decode.replicas" .Values.decode.replicas) | int -}}
{{- mul $r (include "pdserve.decodePerPod" . | int) -}}
{{- end -}}

{{- define "pdserve.decodeGpusPerPod" -}}
{{- mul (include "pdserve.decodeTp" . | int) (include "pdserve.decodePerPod" . | int) -}}
{{- end -}}

{{/* minReplicas <= replicas <= maxReplicas of a worker group; fails otherwise. */}}
{{- define "pdserve.checkBounds" -}}
{{- $name := index . 0 -}}{{- $g := index . 1 -}}
{{- if or (gt (int $g.minReplicas) (int $g.replicas)) (lt (int $g.maxReplicas) (int $g.replicas)) (lt (int $g.minReplicas) 0) -}}
{{- fail (printf "%s: need 0 <= minReplicas (%v) <= replicas (%v) <= maxReplicas (%v)" $name $g.minReplicas $g.replicas $g.maxReplicas) -}}
{{- end -}}
{{- end -}}

{{/* The `pdserve up --config` YAML: .Values.pdserve plus the keys the chart owns. */}}
{{- define "pdserve.settings" -}}
{{- $s := deepCopy (.Values.pdserve | default dict) -}}
{{- range $k := list "prefill_workers" "decode_workers" "decode_tp" "host" "port" "metrics_port" "http_port" "ray_address" "worker_host" "redis_url" "redis_password" "api_token" "api_token_file" "tls_cert" "tls_key" "tls_client_ca" "cluster_tls_cert" "cluster_tls_key" "cluster_tls_ca" "drain_timeout_s" -}}
{{- if hasKey $s $k -}}
{{- fail (printf "pdserve.%s is set by the chart: use prefill.*, decode.*, router.*, redis.*, apiToken.* or clusterTLS.* instead" $k) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $s "prefill_workers" (include "pdserve.prefillWorkers" . | int) -}}
{{- $_ := set $s "decode_workers" (include "pdserve.decodeWorkers" . | int) -}}
{{- $_ := set $s "decode_tp" (include "pdserve.decodeTp" . | int) -}}
{{- $_ := set $s "port" (.Values.router.grpcPort | int) -}}
{{- $_ := set $s "metrics_port" (.Values.router.metricsPort | int) -}}
{{- $_ := set $s "http_port" (.Values.router.httpPort | int) -}}
{{- $_ := set $s "drain_timeout_s" (.Values.router.drainTimeoutSeconds | int) -}}
{{- with .Values.speculativeConfig -}}
{{- if hasKey $s "speculative_config" -}}
{{- fail "pdserve.speculative_config and speculativeConfig are both set: give it once, as speculativeConfig" -}}
{{- end -}}
{{- if hasKey (fromJson .) "Error" -}}
{{- fail (printf "speculativeConfig must be a JSON object, e.g. {\"method\": \"ngram\", \"num_speculative_tokens\": 4}; got %s" .) -}}
{{- end -}}
{{- $_ := set $s "speculative_config" . -}}
{{- end -}}
{{- /* Paths only: the files come from Secrets mounted by the router Deployment. */ -}}
{{- if include "pdserve.apiTokenSecret" . -}}
{{- $_ := set $s "api_token_file" (printf "%s/api-tokens" (include "pdserve.secretsDir" .)) -}}
{{- end -}}
{{- if .Values.router.tls.secretName -}}
{{- $_ := set $s "tls_cert" (printf "%s/tls/tls.crt" (include "pdserve.secretsDir" .)) -}}
{{- $_ := set $s "tls_key" (printf "%s/tls/tls.key" (include "pdserve.secretsDir" .)) -}}
{{- end -}}
{{- if .Values.router.tls.clientCASecretName -}}
{{- if not .Values.router.tls.secretName -}}
{{- fail "router.tls.clientCASecretName needs router.tls.secretName (the server's own certificate)" -}}
{{- end -}}
{{- $_ := set $s "tls_client_ca" (printf "%s/tls/client-ca.crt" (include "pdserve.secretsDir" .)) -}}
{{- end -}}
{{- if .Values.clusterTLS.secretName -}}
{{- $dir := include "pdserve.clusterTLSDir" . -}}
{{- $_ := set $s "cluster_tls_cert" (printf "%s/tls.crt" $dir) -}}
{{- $_ := set $s "cluster_tls_key" (printf "%s/tls.key" $dir) -}}
{{- $_ := set $s "cluster_tls_ca" (printf "%s/ca.crt" $dir) -}}
{{- end -}}
{{- toYaml $s -}}
{{- end -}}

{{/* Secrets: which Secret and key hold the Redis password / API token ("" if none). */}}
{{- define "pdserve.redisPasswordSecret" -}}
{{- if .Values.redis.existingSecret -}}{{- .Values.redis.existingSecret -}}
{{- else if or .Values.redis.password (not .Values.redis.external.url) -}}{{- include "pdserve.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.redisPasswordKey" -}}
{{- if .Values.redis.existingSecret -}}{{- .Values.redis.existingSecretKey -}}{{- else -}}redis-password{{- end -}}
{{- end -}}

{{/* The API tokens the chart itself holds: apiToken.value and apiToken.tokens, one a line. */}}
{{- define "pdserve.apiTokens" -}}
{{- $tokens := concat (list .Values.apiToken.value) (.Values.apiToken.tokens | default list) | compact -}}
{{- range $tokens -}}
{{- if or (regexMatch "\\s" (toString .)) (hasPrefix "#" (toString .)) -}}
{{- fail "apiToken: a token may not contain whitespace nor start with # (the router reads one token a line, # lines are comments)" -}}
{{- end -}}
{{- end -}}
{{- join "\n" $tokens -}}
{{- end -}}

{{- define "pdserve.apiTokenSecret" -}}
{{- if .Values.apiToken.existingSecret -}}{{- .Values.apiToken.existingSecret -}}
{{- else if include "pdserve.apiTokens" . -}}{{- include "pdserve.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.apiTokenKey" -}}
{{- if .Values.apiToken.existingSecret -}}{{- .Values.apiToken.existingSecretKey -}}{{- else -}}api-token{{- end -}}
{{- end -}}

{{/* The cluster secret (worker plane): always present, the chart's own unless existing. */}}
{{- define "pdserve.clusterSecretName" -}}
{{- .Values.clusterSecret.existingSecret | default (include "pdserve.fullname" .) -}}
{{- end -}}

{{- define "pdserve.clusterSecretKey" -}}
{{- if .Values.clusterSecret.existingSecret -}}{{- .Values.clusterSecret.existingSecretKey -}}{{- else -}}cluster-secret{{- end -}}
{{- end -}}

{{/* Where the router's Secrets are mounted (read-only files, never env or argv). */}}
{{- define "pdserve.secretsDir" -}}/etc/pdserve/secrets{{- end -}}

{{/* Secret material in router.extraArgs or as a literal in router.extraEnv: refused (argv
     shows in `ps`; both show in the pod spec to anyone who may read Deployments). */}}
{{- define "pdserve.checkNoLiteralSecrets" -}}
{{- range .Values.router.extraEnv -}}
{{- if and (has .name (list "PDSERVE_API_TOKEN" "PDSERVE_REDIS_PASSWORD" "PDSERVE_CLUSTER_SECRET")) (hasKey . "value") -}}
{{- fail (printf "router.extraEnv: %s as a literal value; take it from a Secret (valueFrom.secretKeyRef) or use apiToken.*, redis.*, clusterSecret.*" .name) -}}
{{- end -}}
{{- end -}}
{{- range .Values.router.extraArgs -}}
{{- $a := toString . -}}
{{- range $flag := list "--api-token" "--redis-password" -}}
{{- if or (eq $a $flag) (hasPrefix (printf "%s=" $flag) $a) -}}
{{- fail (printf "router.extraArgs: %s puts a secret on the command line; use apiToken.* or redis.* (a Secret) instead" $flag) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The router's probes (finding 12 of issue 16). Liveness is "the process is alive", never the
serving status: the router is the Ray driver, so a restart kills every worker, and a decode
worker restarting (NOT_SERVING meanwhile) must not cause one. Readiness is "can serve".
The kubelet's gRPC probe speaks plaintext only, and no kubelet probe presents a client
certificate, so with TLS the HTTP probes go over HTTPS and with mTLS only TCP is left.
*/}}
{{- define "pdserve.routerProbes" -}}
{{- $r := .Values.router -}}
{{- $tls := $r.tls.secretName -}}
{{- $mtls := $r.tls.clientCASecretName -}}
{{- $http := and $r.httpPort (not $mtls) -}}
{{- $scheme := ternary "HTTPS" "HTTP" (not (empty $tls)) -}}
{{- $tcp := dict "tcpSocket" (dict "port" "grpc") -}}
{{- $startup := merge (dict) $tcp $r.startupProbe -}}
{{- $live := $tcp -}}
{{- if $http -}}
{{- $live = dict "httpGet" (dict "path" "/health" "port" "http" "scheme" $scheme) -}}
{{- end -}}
{{- $ready := $tcp -}}
{{- if not $tls -}}
{{- $ready = dict "grpc" (dict "port" ($r.grpcPort | int) "service" "") -}}
{{- else if $http -}}
{{- $ready = dict "httpGet" (dict "path" "/ready" "port" "http" "scheme" $scheme) -}}
{{- end -}}
startupProbe:
  {{- toYaml $startup | nindent 2 }}
readinessProbe:
  {{- toYaml (merge (dict) $ready $r.readinessProbe) | nindent 2 }}
livenessProbe:
  {{- toYaml (merge (dict) $live $r.livenessProbe) | nindent 2 }}
{{- end -}}

{{/* Volumes every Ray container mounts: /tmp (Ray's session dir) and /dev/shm (object store). */}}
{{- define "pdserve.rayVolumes" -}}
- name: tmp
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- end -}}

{{- define "pdserve.rayVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- end -}}

{{/* Worker-plane mutual TLS (clusterTLS.secretName): the same files at the same path in the
     router and every pod that runs pdserve workers; the workers read the paths from their
     WorkerSpec. The Ray head runs no pdserve process and gets no key. */}}
{{- define "pdserve.clusterTLSDir" -}}/etc/pdserve/cluster-tls{{- end -}}

{{- define "pdserve.clusterTLSVolume" -}}
- name: cluster-tls
  secret:
    secretName: {{ .Values.clusterTLS.secretName }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end -}}

{{- define "pdserve.clusterTLSMount" -}}
- name: cluster-tls
  mountPath: {{ include "pdserve.clusterTLSDir" . }}
  readOnly: true
{{- end -}}
